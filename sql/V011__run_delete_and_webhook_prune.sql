-- V011: finished runs can be soft-deleted and webhook deliveries are pruned.
--
-- Engine.delete_run (composer-ops runs delete) sets workflow_runs.deleted_at, a
-- column the seed's schema already has; deleting also gives up the run's pending
-- webhook delivery and drops any dispatch left for it, all as the engine role, which
-- V006 allows. Deleted rows leave physically with their month (retention drops whole
-- partitions; a deleted run is finished, so it never keeps its month).
--
-- The coordinator deletes deliveries delivered or given up more than N days ago
-- (--webhook-keep-days, 7 by default), in small batches, oldest first: the engine role
-- needs DELETE on the table, and the batches read this partial index, which holds
-- only finished deliveries (every delivery ends up in it once, and leaves with it).
GRANT DELETE ON webhook_deliveries TO composer_ops_engine;

CREATE INDEX IF NOT EXISTS idx_webhook_deliveries_done
    ON webhook_deliveries ((COALESCE(delivered_at, gave_up_at)))
    WHERE delivered_at IS NOT NULL OR gave_up_at IS NOT NULL;
