-- MAP nodes: one task per item, in task_instances beside the node's own task.
--
-- An item's row has the MAP node's node_id and its position in the items list as
-- item_index; every other row has item_index NULL. The MAP node's own row (WAITING
-- while its items run) carries the node's counters, so an event on an item reads the
-- node rows of its run, the counters among them, and that one item, never the others:
--   items_total    how many items the list had;
--   items_started  items 0 .. items_started - 1 have been dispatched, in item order;
--   items_done     of those, completed; items_failed: failed for good.
--
-- One task per node stays the safety net, for node rows only; items are unique per
-- node and index. The run-lock load reads a run's node rows through the first index,
-- so a run with 10,000 items loads its few node rows, not the items.
--
-- SUB_WORKFLOW nodes: a child run names the run and node that started it. It lives in
-- the month of its own run ID; the index finds a parent's children (runs show, cancel
-- and retention) without scanning the runs.
--
-- Each statement goes through EXECUTE: on Citus, DDL on a distributed table is sent to
-- the shards with the text of the statement it came in, which must then be that one
-- statement, not this whole file.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE task_instances
                 ADD COLUMN IF NOT EXISTS item_index INT,
                 ADD COLUMN IF NOT EXISTS items_total INT,
                 ADD COLUMN IF NOT EXISTS items_started INT,
                 ADD COLUMN IF NOT EXISTS items_done INT,
                 ADD COLUMN IF NOT EXISTS items_failed INT';
    EXECUTE 'DROP INDEX IF EXISTS idx_task_instances_run_node';
    EXECUTE 'CREATE UNIQUE INDEX IF NOT EXISTS idx_task_instances_run_node
                 ON task_instances (run_id, node_id) WHERE item_index IS NULL';
    EXECUTE 'CREATE UNIQUE INDEX IF NOT EXISTS idx_task_instances_run_node_item
                 ON task_instances (run_id, node_id, item_index) WHERE item_index IS NOT NULL';
    EXECUTE 'ALTER TABLE workflow_runs
                 ADD COLUMN IF NOT EXISTS parent_run_id TEXT COLLATE "C",
                 ADD COLUMN IF NOT EXISTS parent_node_id TEXT';
    EXECUTE 'CREATE INDEX IF NOT EXISTS idx_workflow_runs_parent
                 ON workflow_runs (parent_run_id) WHERE parent_run_id IS NOT NULL';
END;
$$;
