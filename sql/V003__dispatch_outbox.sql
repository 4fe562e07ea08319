-- V003: dispatch outbox and webhook deliveries (SPEC section 6).
--
-- Creating or re-queuing a TASK writes a task_outbox row in the same transaction.
-- A worker claims with one statement that deletes the row (FOR UPDATE SKIP LOCKED)
-- and moves the task to RUNNING, fenced on attempt. The outbox is a queue: rows are
-- inserted and deleted, never updated, so it stays small and is not partitioned.
CREATE TABLE IF NOT EXISTS task_outbox(
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue TEXT NOT NULL,
    -- stream shard within the queue (hash of the run ID); lets a deployment spread
    -- claimers over shards; 0 when the queue has one stream
    shard SMALLINT NOT NULL DEFAULT 0,
    run_id TEXT COLLATE "C" NOT NULL,
    task_id TEXT COLLATE "C" NOT NULL,
    attempt INT NOT NULL,
    task_name TEXT NOT NULL,    -- the handler a worker runs (the node's "task")
    lease_s INT NOT NULL,       -- lease granted at claim
    available_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),  -- retry backoff delays this
    created_at TIMESTAMPTZ NOT NULL DEFAULT NOW()
) WITH (autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 500);

-- The claim's scan: oldest available first, per queue.
CREATE INDEX IF NOT EXISTS idx_task_outbox_ready ON task_outbox (queue, available_at, id);
-- One pending dispatch per task; cancelling a run deletes its rows through this.
CREATE UNIQUE INDEX IF NOT EXISTS idx_task_outbox_task ON task_outbox (run_id, task_id);

-- Webhook relay: one row per finished run of a definition with a webhook_url,
-- written in the transaction that finished the run; delivered at least once.
CREATE TABLE IF NOT EXISTS webhook_deliveries(
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id TEXT COLLATE "C" NOT NULL,
    url TEXT NOT NULL,
    payload JSONB NOT NULL,
    attempts INT NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    delivered_at TIMESTAMPTZ,
    gave_up_at TIMESTAMPTZ,
    last_status INT,
    last_error TEXT,
    created_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    UNIQUE (run_id)
);
CREATE INDEX IF NOT EXISTS idx_webhook_deliveries_due
    ON webhook_deliveries (next_attempt_at)
    WHERE delivered_at IS NULL AND gave_up_at IS NULL;

-- The run's result: the outputs of the nodes nothing depends on, keyed by node id.
-- (context_json stays {input, config}; adding a nullable column rewrites nothing.)
ALTER TABLE workflow_runs ADD COLUMN IF NOT EXISTS output_json JSONB;
