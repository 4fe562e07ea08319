-- V004: the retention plan as the single source of truth, and a read-only role.
--
-- composer_retention_plan(older_than) says, for every partition month of the three
-- run-scoped tables, whether retention drops it and why. composer_drop_partitions
-- (same signature and promise as the seed's) now drops exactly the months the plan
-- marks 'drop', so `composer-ops partitions drop` (dry-run) and `--yes` cannot
-- disagree. The plan adds one guard the seed lacked: the current and future months
-- are never dropped, whatever the cut-off.
--
-- composer_ops_reader is the role the notebooks and reports run as: CONNECT, USAGE
-- and SELECT only, including on partitions created later (default privileges).
-- The functions that create or drop partitions are no longer executable by PUBLIC.

-- One row per partition month (YYYYMM suffix), oldest first:
--   action 'drop' | 'keep'; reason 'too new' | 'has active runs' | 'past cut-off, no active runs';
--   active_runs / active_run_ids: RUNNING or PENDING runs of the month (first 20 ids);
--   rows: reltuples estimates (exact counts when exact_rows), bytes: heap + indexes + toast,
--   both summed over the month's partitions of the three tables.
-- Reads catalogs, plus one query per month old enough to drop on that month's
-- workflow_runs partition (its status is not indexed; old months are small and cold).
CREATE OR REPLACE FUNCTION composer_retention_plan(older_than TIMESTAMPTZ, exact_rows BOOLEAN DEFAULT false)
RETURNS TABLE(month TEXT, month_start TIMESTAMPTZ, month_end TIMESTAMPTZ, action TEXT, reason TEXT,
              active_runs BIGINT, active_run_ids TEXT[], partitions TEXT[], rows BIGINT, bytes BIGINT)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    m RECORD;
    part TEXT;
    n BIGINT;
    runs_part TEXT;
    horizon TIMESTAMPTZ;
BEGIN
    IF older_than IS NULL THEN
        RAISE EXCEPTION 'older_than must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- Never the current or a future month, even for a cut-off in the future.
    horizon := LEAST(older_than, composer_month_start((now() AT TIME ZONE 'UTC')::date));
    FOR m IN
        SELECT s.suffix,
               array_agg(s.relname ORDER BY s.table_order) AS parts,
               sum(pg_total_relation_size(s.oid))::bigint AS total_bytes,
               sum(CASE WHEN s.reltuples >= 0 THEN s.reltuples
                        ELSE pg_stat_get_live_tuples(s.oid) END)::bigint AS est_rows
          FROM (SELECT c.oid, c.relname::text AS relname, c.reltuples,
                       array_position(ARRAY['workflow_runs', 'task_instances', 'workflow_events'],
                                      p.relname::text) AS table_order,
                       substring(c.relname FROM '_p(\d{6})$') AS suffix
                  FROM pg_inherits i
                  JOIN pg_class c ON c.oid = i.inhrelid
                  JOIN pg_class p ON p.oid = i.inhparent
                 WHERE p.oid IN ('workflow_runs'::regclass, 'task_instances'::regclass,
                                 'workflow_events'::regclass)) s
         WHERE composer_suffix_month(s.suffix) IS NOT NULL
         GROUP BY s.suffix
         ORDER BY s.suffix
    LOOP
        month := m.suffix;
        month_start := composer_suffix_month(m.suffix)::timestamp AT TIME ZONE 'UTC';
        month_end := (composer_suffix_month(m.suffix) + INTERVAL '1 month') AT TIME ZONE 'UTC';
        partitions := m.parts;
        bytes := m.total_bytes;
        rows := m.est_rows;
        IF exact_rows THEN
            rows := 0;
            FOREACH part IN ARRAY m.parts LOOP
                EXECUTE format('SELECT count(*) FROM %I', part) INTO n;
                rows := rows + n;
            END LOOP;
        END IF;
        active_runs := 0;
        active_run_ids := ARRAY[]::TEXT[];
        IF month_end > horizon THEN
            action := 'keep';
            reason := 'too new';
        ELSE
            runs_part := 'workflow_runs_p' || m.suffix;
            IF runs_part = ANY(m.parts) THEN
                EXECUTE format('SELECT count(*), COALESCE((array_agg(id ORDER BY id))[1:20], ARRAY[]::TEXT[])
                                  FROM %I WHERE status IN (''RUNNING'', ''PENDING'')', runs_part)
                   INTO active_runs, active_run_ids;
            END IF;
            IF active_runs > 0 THEN
                action := 'keep';
                reason := 'has active runs';
            ELSE
                action := 'drop';
                reason := 'past cut-off, no active runs';
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;

-- The seed's retention entry point, same signature and promise (drop whole UTC months
-- that ended at or before older_than and have no active run; return their YYYYMM),
-- now a loop over the plan's 'drop' rows. The plan is materialised before the first
-- DROP, under the partition advisory lock.
CREATE OR REPLACE FUNCTION composer_drop_partitions(older_than TIMESTAMPTZ) RETURNS SETOF TEXT
LANGUAGE plpgsql AS $$
DECLARE
    p RECORD;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('composer_partitions'));
    FOR p IN SELECT plan.month FROM composer_retention_plan(older_than) plan
              WHERE plan.action = 'drop' ORDER BY plan.month
    LOOP
        -- Referencing tables first, so their foreign keys never see orphans.
        EXECUTE format('DROP TABLE IF EXISTS %I', 'workflow_events_p' || p.month);
        EXECUTE format('DROP TABLE IF EXISTS %I', 'task_instances_p' || p.month);
        IF to_regclass(format('%I', 'workflow_runs_p' || p.month)) IS NOT NULL THEN
            EXECUTE format('ALTER TABLE workflow_runs DETACH PARTITION %I', 'workflow_runs_p' || p.month);
            EXECUTE format('DROP TABLE %I', 'workflow_runs_p' || p.month);
        END IF;
        RETURN NEXT p.month;
    END LOOP;
END;
$$;

-- Only the owner (or a role it grants EXECUTE to) creates or drops partitions.
REVOKE EXECUTE ON FUNCTION composer_drop_partitions(TIMESTAMPTZ) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION composer_ensure_partitions(INT) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION composer_ensure_partitions_from(DATE, INT) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION composer_repair_partition_bounds() FROM PUBLIC;

-- Roles are cluster-wide and many databases of one cluster run this migration
-- (every test database, staging next to production), so create it only once, and
-- tolerate another migrator creating it at the same moment. NOLOGIN: people and
-- report jobs log in as their own role and are granted this one.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'composer_ops_reader') THEN
        CREATE ROLE composer_ops_reader NOLOGIN;
    END IF;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN
        NULL;
    WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'cannot create role composer_ops_reader: %', SQLERRM
            USING HINT = 'create it once as a role with CREATEROLE (CREATE ROLE composer_ops_reader NOLOGIN), '
                         'then run the migration again';
END;
$$;

DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO composer_ops_reader', current_database());
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO composer_ops_reader', current_schema());
    -- Existing tables and partitions, then everything this role creates later
    -- (composer_ensure_partitions run as the owner creates next month's partitions).
    EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA %I TO composer_ops_reader', current_schema());
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT ON TABLES TO composer_ops_reader',
                   current_schema());
END;
$$;
