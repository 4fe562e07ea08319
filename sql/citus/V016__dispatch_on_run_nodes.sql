-- Citus only: the dispatch rows live with their run (docs/scaling.md, "Dispatch on Citus").
--
-- task_outbox and webhook_deliveries become distributed by run_id, co-located with
-- workflow_runs: a task and its outbox row, a finished run and its webhook delivery, are
-- on one shard group, so the event that writes them commits on one node, in one phase,
-- and they are atomic by design (no two-phase commit over the nodes, no coordinator
-- table written by an event). Citus needs the distribution column in every unique key:
-- the primary keys become (run_id, id); the unique (run_id, task_id) and (run_id) keys
-- already hold it. The identity columns stay (Citus gives each node its own range).
-- The event's one write, composer_apply_on (sql/R__apply.sql), is delegated to the run's
-- node and the claim is one delegated call per node (sql/citus/R__claim_node.sql).
-- A node's claim asks each of its shards whether rows with a concurrency key or a rate
-- limit are ready (they are the coordinator claim's): through this index, not the rows. Made
-- before the table is distributed (Citus copies it to the shards): a CREATE INDEX on a
-- distributed table in a script of several statements fails on the worker nodes.
CREATE INDEX IF NOT EXISTS idx_task_outbox_flow ON task_outbox (queue, available_at)
    WHERE ckey IS NOT NULL OR rkey IS NOT NULL;
ALTER TABLE task_outbox DROP CONSTRAINT task_outbox_pkey;
ALTER TABLE task_outbox ADD PRIMARY KEY (run_id, id);
SELECT create_distributed_table('task_outbox', 'run_id', colocate_with => 'workflow_runs');

ALTER TABLE webhook_deliveries DROP CONSTRAINT webhook_deliveries_pkey;
ALTER TABLE webhook_deliveries ADD PRIMARY KEY (run_id, id);
SELECT create_distributed_table('webhook_deliveries', 'run_id', colocate_with => 'workflow_runs');

-- Flow control (docs/scaling.md, "Dispatch on Citus"): the queue settings become a
-- reference table, so a node's claim reads them where it runs (a paused queue gives
-- nothing, a queue with a limit is left to the coordinator's claim); pause, resume
-- and set-limit, rare operator actions, write every node. flow_slots and rate_buckets
-- stay on the coordinator: a dispatch with a limit (its queue's, a concurrency key, a
-- rate limit) is claimed there, with its place, in one transaction over the nodes.
SELECT create_reference_table('queue_settings');
