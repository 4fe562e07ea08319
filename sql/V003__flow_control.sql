-- V003: flow control (issue 26, SPEC.md sections 5 and 8): the operators' queue settings,
-- the slots that count running attempts against a limit, and the outbox's priority.

-- One row per queue an operator has touched (`composer-ops queues pause|resume|set-limit`);
-- a queue without a row is open and unlimited. Every claim reads the rows of its queues
-- (sql/R__claim.sql): a paused queue gives nothing (its tasks stay in the outbox), a
-- queue with max_running > 0 gives at most that many RUNNING attempts at once.
CREATE TABLE IF NOT EXISTS queue_settings(
    queue TEXT PRIMARY KEY,
    paused BOOLEAN NOT NULL DEFAULT false,
    reason TEXT,                          -- the operator's --reason of the pause
    paused_at TIMESTAMPTZ,                -- database clock; check alerts on a long pause
    max_running INT NOT NULL DEFAULT 0 CHECK (max_running >= 0),   -- 0: no limit
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- A running attempt holding a place under a limit ('queue:<name>'): inserted by the
-- claim that starts it, in the same statement, and deleted when the attempt leaves
-- RUNNING (the trigger in sql/R__claim.sql) or, after anything that bypassed it, by
-- the lease sweeper. A claim counts a key's rows under that key's advisory lock, so
-- racing claims never exceed the limit. Few rows: at most the running attempts.
CREATE TABLE IF NOT EXISTS flow_slots(
    key TEXT NOT NULL,
    run_id TEXT COLLATE "C" NOT NULL,
    task_id TEXT COLLATE "C" NOT NULL,
    attempt INT NOT NULL,
    taken_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (key, run_id, task_id)
);
CREATE INDEX IF NOT EXISTS idx_flow_slots_task ON flow_slots (run_id, task_id);

-- Set by the claim on a task whose attempt took a slot, so that only those tasks run
-- the trigger that frees it (NULL otherwise: a task without limits pays nothing).
ALTER TABLE task_instances ADD COLUMN IF NOT EXISTS flow_slot BOOLEAN;

-- Priority: higher first within a queue. The claim's scan becomes (queue, priority
-- DESC, available_at, id); with every priority 0 it reads the same rows in the same
-- order as the index it replaces.
ALTER TABLE task_outbox ADD COLUMN IF NOT EXISTS priority SMALLINT NOT NULL DEFAULT 0;
DROP INDEX IF EXISTS idx_task_outbox_ready;
CREATE INDEX IF NOT EXISTS idx_task_outbox_ready ON task_outbox (queue, priority DESC, available_at, id);

-- start_to_close (timeouts.start_to_close_s): the outbox row carries the seconds, the claim
-- sets the attempt's deadline, and neither the claim's lease nor a heartbeat passes it. NULL:
-- no deadline. Not indexed: a heartbeat changing lease_expires_at stays a HOT update.
ALTER TABLE task_outbox ADD COLUMN IF NOT EXISTS max_run_s INT;
ALTER TABLE task_instances ADD COLUMN IF NOT EXISTS run_deadline_at TIMESTAMPTZ;

-- schedule_to_start (timeouts.schedule_to_start_s): the instant by which a dispatch must be
-- claimed; the coordinator's timer loop reads the rows past it through this partial index
-- (only dispatches with a deadline) and fails their tasks.
ALTER TABLE task_outbox ADD COLUMN IF NOT EXISTS start_by TIMESTAMPTZ;
CREATE INDEX IF NOT EXISTS idx_task_outbox_start_by ON task_outbox (start_by) WHERE start_by IS NOT NULL;

-- concurrency {key, limit} and rate_limit {key, per_s, burst}: the keys resolved when the
-- task is dispatched, and the node's numbers. NULL: none (the claim then pays nothing).
ALTER TABLE task_outbox ADD COLUMN IF NOT EXISTS ckey TEXT;
ALTER TABLE task_outbox ADD COLUMN IF NOT EXISTS climit INT;
ALTER TABLE task_outbox ADD COLUMN IF NOT EXISTS rkey TEXT;
ALTER TABLE task_outbox ADD COLUMN IF NOT EXISTS rate_per_s FLOAT8;
ALTER TABLE task_outbox ADD COLUMN IF NOT EXISTS rate_burst INT;

-- One token bucket per rate_limit key, shared by every worker: refilled by the claim from
-- the database clock (per_s since updated_at, up to burst), one token per task claimed.
CREATE TABLE IF NOT EXISTS rate_buckets(
    key TEXT PRIMARY KEY,
    tokens FLOAT8 NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL
);

GRANT SELECT, INSERT, UPDATE ON rate_buckets TO composer_ops_engine;
GRANT SELECT, INSERT, UPDATE ON queue_settings TO composer_ops_engine;
GRANT SELECT, INSERT, UPDATE, DELETE ON flow_slots TO composer_ops_engine;
