-- Citus only: child_deliveries (sql/V009) distributed by run_id, co-located with
-- workflow_runs, so a decision writes its row on its own run's node. A repeatable file
-- rather than a V file: it also distributes the table of a single-server database
-- converted to Citus, whose V009 ran before sql/citus/V002 distributed the runs.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = 'child_deliveries'::regclass) THEN
        PERFORM create_distributed_table('child_deliveries', 'run_id', colocate_with => 'workflow_runs');
    END IF;
END;
$$;
