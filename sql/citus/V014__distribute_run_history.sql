-- V014 (Citus only): every run table distributed, whatever order the database was
-- migrated in.
--
-- On a database that was a Citus coordinator when V012 ran, V012 distributed
-- run_history itself and this finds nothing to do. A single-server database converted
-- later (docs/scaling.md) met V012 without Citus: its run_history is a plain table on
-- the coordinator, which V007 (its list of tables fixed when it shipped) does not
-- distribute. Every table composer_run_tables() names that Citus does not know yet is
-- distributed here, co-located with workflow_runs by run ID; its existing rows move
-- to the shards.
DO $$
DECLARE
    tbl TEXT;
BEGIN
    FOREACH tbl IN ARRAY composer_run_tables() LOOP
        CONTINUE WHEN tbl = 'workflow_runs'
            OR EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = tbl::regclass);
        PERFORM create_distributed_table(tbl, 'run_id', colocate_with => 'workflow_runs');
    END LOOP;
END;
$$;
