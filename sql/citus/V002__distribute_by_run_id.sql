-- Citus only: distribute the run tables by run ID (the baseline's Citus half).
--
-- Applied by `composer-ops migrate` on a Citus coordinator (a database with the citus
-- extension and its worker nodes added), skipped on a single PostgreSQL server. After it:
--   workflow_definitions                a reference table (copied to every node: every
--                                       start reads it, deploys are rare);
--   workflow_runs (id), task_instances, workflow_events, run_history (run_id)
--                                       hash-distributed and co-located: every row of a
--                                       run is on one shard, so an event (run lock, tasks,
--                                       signals) is a single-shard transaction, and the
--                                       foreign keys to the run hold shard by shard;
--   task_outbox, webhook_deliveries     stay plain tables on the coordinator: their
--                                       claims take the oldest rows of all runs (FOR UPDATE
--                                       SKIP LOCKED), which Citus allows on one node only.
--                                       A transaction that dispatches therefore writes on the
--                                       coordinator and on one worker (two-phase commit);
--                                       the coordinator commits first, so a claimer can see
--                                       an outbox row before its task row is visible.
-- Their partitions follow: a distributed partitioned table's partitions are distributed
-- tables co-located with it, and partitions created or dropped later on the coordinator
-- (composer_ensure_partitions_from, composer_drop_partitions) are propagated. The
-- repeatable files, applied after this, put those functions in sequential mode on Citus.
--
-- Order matters. A reference table referenced by foreign keys from plain tables turns
-- those tables (runs, then tasks and events through their keys) into Citus local tables,
-- and create_distributed_table then refuses them ("foreign keys from reference tables
-- and local tables to distributed tables are not supported"). So workflow_definitions
-- is made a reference table with citus.enable_local_reference_table_foreign_keys off,
-- for that statement only, and runs are distributed before the tables that reference them.
--
-- The shard count is the cluster's citus.shard_count (32 unless configured). Existing
-- rows are copied into the shards by create_distributed_table: converting a populated
-- single-node database takes time in proportion to its data and blocks writes meanwhile
-- (docs/scaling.md).

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_dist_node WHERE isactive AND noderole = 'primary' AND shouldhaveshards) THEN
        RAISE EXCEPTION 'no Citus node takes shards: add the worker nodes first (SELECT citus_add_node(host, port))'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
END;
$$;

SET LOCAL citus.enable_local_reference_table_foreign_keys = off;
SELECT create_reference_table('workflow_definitions');
RESET citus.enable_local_reference_table_foreign_keys;

SELECT create_distributed_table('workflow_runs', 'id');
SELECT create_distributed_table('task_instances', 'run_id', colocate_with => 'workflow_runs');
SELECT create_distributed_table('workflow_events', 'run_id', colocate_with => 'workflow_runs');
SELECT create_distributed_table('run_history', 'run_id', colocate_with => 'workflow_runs');
