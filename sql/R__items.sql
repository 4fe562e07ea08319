-- MAP items: statistics for a month's task partition that has none yet. A repeatable
-- file (docs/architecture.md, "where new code goes").
--
-- A MAP node inserts its items, thousands of rows of one run, in one statement. On a
-- month's task partition that has no column statistics yet (a new month, before
-- autovacuum's first analyze) the planner cannot tell the partition's indexes apart:
-- an item's lookups by primary key, by (run, node, item) and the fenced updates then go
-- through an index on run_id alone and read every item of the run (measured at 10,000
-- items: about 2 ms per statement instead of 0.1). The engine role may not ANALYZE; it
-- may call this, which analyzes that one partition, only while it has no statistics
-- (so at most about once a month), in the caller's transaction, whose own new rows the
-- sample counts. Returns whether it analyzed. Not on Citus: the coordinator's
-- partitions are empty shells, and the shards are analyzed on the worker nodes.
CREATE OR REPLACE FUNCTION composer_analyze_new_tasks(part TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF part IS NULL OR part !~ '^task_instances_p[0-9]{6}$' THEN
        RAISE EXCEPTION 'not a month partition of task_instances: %', part USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF to_regclass(format('%I', part)) IS NULL OR EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')
       OR EXISTS (SELECT 1 FROM pg_stats s WHERE s.schemaname = current_schema() AND s.tablename = part
                                             AND s.attname = 'run_id') THEN
        RETURN false;
    END IF;
    EXECUTE format('ANALYZE %I', part);
    RETURN true;
END;
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION composer_analyze_new_tasks(TEXT) SET search_path = %I, pg_temp', current_schema());
END;
$$;

REVOKE ALL ON FUNCTION composer_analyze_new_tasks(TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_analyze_new_tasks(TEXT) TO composer_ops_engine;
