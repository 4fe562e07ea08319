-- V006: least privilege for the engine (docs/security.md).
--
-- Three roles use a Composer database:
--   the owner             runs migrations and owns every table and function; the only
--                         role that can drop or detach partitions (`composer-ops
--                         partitions drop`, composer_drop_partitions), back-fill past
--                         months (composer_ensure_partitions_from) or repair bounds;
--   composer_ops_engine   coordinators, workers and the applications that deploy,
--                         start, signal and cancel: reads and writes rows of the
--                         engine's tables, nothing else (this file);
--   composer_ops_reader   notebooks and reports: SELECT only (V004).
--
-- Creating a partition needs ownership of its parent table, and the coordinator's
-- partition upkeep creates next months' partitions every hour. Rather than run a
-- second, owner-privileged process for that, composer_ensure_partitions(INT) runs as
-- its owner (SECURITY DEFINER) and is the one thing the engine role may call:
--   * it takes one integer, capped here at 120 months (the engine role cannot create
--     thousands of tables), and creates only the current UTC month and the months
--     after it, named and bounded by the function itself, never by its caller;
--   * its search_path is fixed to the schema it lives in, with pg_temp last, so a
--     caller cannot shadow the tables it touches (temporary tables) or the functions
--     it calls (pg_catalog is searched first, and the engine role cannot CREATE in the
--     schema; on PostgreSQL 14 and older revoke CREATE on public from PUBLIC).
-- The back-fill variant composer_ensure_partitions_from (any first month) stays with
-- the owner. A later migration that replaces composer_ensure_partitions must repeat
-- SECURITY DEFINER and the SET search_path (CREATE OR REPLACE resets both);
-- tests/integration/test_roles.py fails if it does not.
--
-- Roles are cluster-wide and many databases of one cluster run this file (every test
-- database, staging next to production): created once, tolerating a concurrent
-- migrator; grants are per database. NOLOGIN: deployments log in as their own roles
-- and are granted this one.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'composer_ops_engine') THEN
        CREATE ROLE composer_ops_engine NOLOGIN;
    END IF;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN
        NULL;
    WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'cannot create role composer_ops_engine: %', SQLERRM
            USING HINT = 'create it once as a role with CREATEROLE (CREATE ROLE composer_ops_engine NOLOGIN), '
                         'then run the migration again';
END;
$$;

-- The seed's entry point, same signature and promise (this UTC month and N ahead),
-- now bounded and running as its owner.
CREATE OR REPLACE FUNCTION composer_ensure_partitions(months_ahead INT DEFAULT 3) RETURNS INT
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF months_ahead IS NULL OR months_ahead < 0 OR months_ahead > 120 THEN
        RAISE EXCEPTION 'months_ahead must be between 0 and 120, got %', months_ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN composer_ensure_partitions_from((now() AT TIME ZONE 'UTC')::date, months_ahead);
END;
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION composer_ensure_partitions(INT) SET search_path = %I, pg_temp',
                   current_schema());
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO composer_ops_engine', current_database());
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO composer_ops_engine', current_schema());
END;
$$;

REVOKE ALL ON FUNCTION composer_ensure_partitions(INT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_ensure_partitions(INT) TO composer_ops_engine;

-- Exactly the statements the engine runs (composer_ops/repo): definitions are
-- soft-deleted, runs and their rows leave only with their partition, the outbox is
-- a queue (its claim's FOR UPDATE needs UPDATE). Partitions are reached through their
-- parents, whose privileges are the ones checked, so none are granted on the
-- partitions themselves.
GRANT SELECT, INSERT, UPDATE ON workflow_definitions, workflow_runs, task_instances, workflow_events,
    webhook_deliveries TO composer_ops_engine;
GRANT SELECT, INSERT, UPDATE, DELETE ON task_outbox TO composer_ops_engine;
