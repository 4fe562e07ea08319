-- The one way the engine removes tasks: those a retry runs again. A repeatable file
-- (docs/architecture.md, "where new code goes").
--
-- A retry (Engine.retry, `composer-ops runs retry`) removes the finished tasks of the
-- nodes that run again, so that the state machine creates them anew. The engine role
-- may not delete tasks; it may call this function, which runs as its owner and removes
-- only finished tasks of a run that is itself finished (FAILED or CANCELLED: the retry
-- removes them before it reopens the run, under the run's lock). Returns how many it
-- removed; the caller rolls back unless that is every task it named. Like
-- composer_ensure_partitions, its search_path is fixed (set below, after every
-- CREATE OR REPLACE, which resets it).
CREATE OR REPLACE FUNCTION composer_reset_tasks(run TEXT, task_ids TEXT[]) RETURNS INT
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    removed INT;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM workflow_runs
                    WHERE id = run AND status IN ('FAILED', 'CANCELLED') AND deleted_at IS NULL) THEN
        RETURN 0;
    END IF;
    DELETE FROM task_instances
     WHERE run_id = run AND id = ANY(task_ids) AND state IN ('COMPLETED', 'FAILED', 'SKIPPED', 'CANCELLED');
    GET DIAGNOSTICS removed = ROW_COUNT;
    RETURN removed;
END;
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION composer_reset_tasks(TEXT, TEXT[]) SET search_path = %I, pg_temp',
                   current_schema());
END;
$$;

REVOKE ALL ON FUNCTION composer_reset_tasks(TEXT, TEXT[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_reset_tasks(TEXT, TEXT[]) TO composer_ops_engine;
