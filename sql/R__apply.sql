-- An event's SQL on the server: its lock and load (composer_load_run), and the one
-- function its write calls when a fenced update misses (composer_fail). A repeatable
-- file (docs/architecture.md, "where new code goes"; the write path). The write itself
-- is one statement the engine builds and prepares (composer_ops/repo/writes.py,
-- statement): no PL/pgSQL between the engine and its rows.

-- The functions that wrote an event before its one statement did (composer_apply and
-- composer_apply_on, the fenced updates on the partitioned tables and of each month):
-- gone.
DROP FUNCTION IF EXISTS composer_apply_on(TEXT, JSONB);
DROP FUNCTION IF EXISTS composer_apply(JSONB);
DROP FUNCTION IF EXISTS composer_apply_updates(TEXT, JSONB, TIMESTAMPTZ);
DROP FUNCTION IF EXISTS composer_apply_updates_source(TEXT, TEXT, TEXT, TEXT);
DO $$
DECLARE
    f TEXT;
BEGIN
    FOR f IN SELECT p.proname FROM pg_proc p
              WHERE p.proname ~ '^composer_apply_updates_p\d{6}$' AND p.pronamespace = current_schema()::regnamespace LOOP
        EXECUTE format('DROP FUNCTION %I(TEXT, JSONB, TIMESTAMPTZ)', f);
    END LOOP;
END;
$$;

-- Raise p_message with SQLSTATE p_state (and p_detail): what the event's statement
-- calls, in a CASE, when a fenced update matched no row (CO409, a Conflict:
-- composer_ops/db/errors.py) or the database
-- refuses a start (CO412, why, and the clock as detail: StartRefused), which rolls the
-- whole event back. Called only then: the statement's own SQL does the rest.
CREATE OR REPLACE FUNCTION composer_fail(p_state TEXT, p_message TEXT, p_detail TEXT DEFAULT NULL) RETURNS TEXT
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = p_state, MESSAGE = p_message, DETAIL = COALESCE(p_detail, '');
END;
$$;
REVOKE ALL ON FUNCTION composer_fail(TEXT, TEXT, TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_fail(TEXT, TEXT, TEXT) TO composer_ops_engine;

-- The event's first statement (repo/runs.py lock_and_load), as the text of a CREATE
-- FUNCTION p_fn(p_run) on the tables p_runs and p_tasks. One text, two uses (the
-- claim's step 3 does the same, sql/R__claim.sql composer_claim_tasks_source):
-- composer_load_run_pYYYYMM on the month's own partitions (made and dropped by
-- composer_load_month), an ordinary table's statements, so PL/pgSQL caches their plans
-- and they lock that month only; composer_load_run on the partitioned tables, for a run
-- ID that is not a UUIDv7, a month without its function, and Citus: a cached generic
-- plan would lock every month before pruning (PostgreSQL 15 to 18), so it is planned at
-- every call with the run ID's value (force_custom_plan) and keeps its month only.
-- It takes the run's row lock (a run deleted counts as missing) and returns one row: the
-- database clock (the event's one instant, repo/clock.py), the run's columns, and its
-- tasks but a MAP's items as one JSON array of arrays, in the order repo/runs.py reads
-- them: [node_id, id, state, attempt, branches, signal_name (while WAITING), lease_owner,
-- lease_expires_at, created_at, wake_at, lease_expiries, items_total, items_started,
-- items_done, items_failed]; o_run is NULL when there is no such run. Two statements:
-- in a VOLATILE function each takes its own snapshot, so the tasks are read after the
-- lock is granted and see everything its previous holder committed. (One statement
-- joining both would read them with the snapshot it took before it waited for the
-- lock, and could miss a sibling's completion: the join race the lock exists to prevent.)
CREATE OR REPLACE FUNCTION composer_load_run_source(p_fn TEXT, p_runs TEXT, p_tasks TEXT, p_options TEXT)
RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $src$
    SELECT format($fn$
CREATE OR REPLACE FUNCTION %1$I(p_run TEXT, OUT o_now TIMESTAMPTZ, OUT o_run TEXT, OUT o_workflow TEXT,
                               OUT o_version INT, OUT o_status TEXT, OUT o_parent TEXT, OUT o_parent_node TEXT,
                               OUT o_tasks JSON)
LANGUAGE plpgsql VOLATILE
%4$s
AS $body$
BEGIN
    o_now := now();
    SELECT r.id, r.workflow_definition_id, r.workflow_version, r.status, r.parent_run_id, r.parent_node_id
      INTO o_run, o_workflow, o_version, o_status, o_parent, o_parent_node
      FROM %2$I r
     WHERE r.id = p_run AND r.deleted_at IS NULL
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT json_agg(json_build_array(t.node_id, t.id, t.state, t.attempt, t.branches,
                                     CASE WHEN t.state = 'WAITING' THEN t.signal_name END, t.lease_owner,
                                     t.lease_expires_at, t.created_at, t.wake_at, t.lease_expiries, t.items_total,
                                     t.items_started, t.items_done, t.items_failed))
      INTO o_tasks
      FROM %3$I t
     WHERE t.run_id = p_run AND t.item_index IS NULL;
END;
$body$;
REVOKE ALL ON FUNCTION %1$I(TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION %1$I(TEXT) TO composer_ops_engine;
$fn$, p_fn, p_runs, p_tasks, p_options)
$src$;

DO $$
BEGIN
    EXECUTE composer_load_run_source('composer_load_run', 'workflow_runs', 'task_instances',
                                     'SET plan_cache_mode = force_custom_plan');
END;
$$;

-- Make (p_replace: or make again) composer_load_run_p<p_month> (YYYYMM) when the
-- month's workflow_runs and task_instances partitions are attached with exactly that
-- month's bounds, and drop it otherwise (a month dropped, detached or misaligned); true
-- when it exists afterwards. Called wherever the claim's function of the month is
-- (composer_claim_month, sql/R__claim.sql: R__partitions.sql, the retention drop, the
-- archive's removal of a month). Not on Citus.
DROP FUNCTION IF EXISTS composer_apply_month(TEXT, BOOLEAN);
CREATE OR REPLACE FUNCTION composer_load_month(p_month TEXT, p_replace BOOLEAN DEFAULT false)
RETURNS BOOLEAN
LANGUAGE plpgsql AS $$
DECLARE
    load TEXT := 'composer_load_run_p' || p_month;
BEGIN
    IF p_month IS NULL OR p_month !~ '^\d{6}$' OR EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
        RETURN false;
    END IF;
    IF NOT composer_month_aligned(p_month) THEN
        EXECUTE format('DROP FUNCTION IF EXISTS %I(TEXT)', load);
        RETURN false;
    END IF;
    IF p_replace OR to_regproc(format('%I', load)) IS NULL THEN
        EXECUTE composer_load_run_source(load, 'workflow_runs_p' || p_month, 'task_instances_p' || p_month, '');
    END IF;
    RETURN true;
END;
$$;
REVOKE ALL ON FUNCTION composer_load_month(TEXT, BOOLEAN) FROM PUBLIC;
