-- Schedules: cron expressions in a time zone whose slots the coordinator starts as runs.
--
-- schedules: one row per schedule. A deleted schedule keeps its row (deleted_at) so its
-- runs and events still name it; a new schedule of the same name gets a new id, so its
-- slot run IDs (a hash of the id and the slot: composer_ops/core/schedules.py) are new.
-- next_slot_at is the slot cursor: the first slot no pass has decided yet. wake_at is
-- when a coordinator looks at the schedule again (the cursor, or sooner while a slot is
-- buffered behind an active run); the coordinator reads only rows whose wake_at has
-- come, through the partial index, so a pass costs the due schedules, not all of them.
--
-- The counters and the last missed slot are kept on the row so that `schedules list` and
-- `check` read one row per schedule, however long its history.
--
-- schedule_events: what happened to the slots, for reports: a run started
-- (a slot on time or caught up, a trigger, a backfill), a slot buffered, and runs of
-- consecutive slots missed (catch-up policy) or skipped (overlap policy), folded into
-- one row with their count, first and last slot.
--
-- On Citus both stay plain tables on the coordinator (like task_outbox): the pass locks
-- due rows with FOR UPDATE SKIP LOCKED, which Citus allows on one node only; a slot's
-- run is on its own shard, so starting one writes the coordinator and one worker node.

CREATE TABLE IF NOT EXISTS schedules(
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    workflow_id TEXT NOT NULL,
    cron TEXT NOT NULL,
    timezone TEXT NOT NULL,
    input_json JSONB,
    overlap TEXT NOT NULL DEFAULT 'skip' CHECK (overlap IN ('skip', 'buffer_one', 'allow')),
    catchup TEXT NOT NULL DEFAULT 'latest' CHECK (catchup IN ('none', 'latest', 'all')),
    paused BOOLEAN NOT NULL DEFAULT false,
    next_slot_at TIMESTAMPTZ,
    wake_at TIMESTAMPTZ,
    buffered_slot_at TIMESTAMPTZ,
    last_slot_at TIMESTAMPTZ,
    last_run_id TEXT,
    last_started_at TIMESTAMPTZ,
    missed_slots BIGINT NOT NULL DEFAULT 0,      -- slots not started by the catch-up policy, or unstartable
    skipped_slots BIGINT NOT NULL DEFAULT 0,     -- slots not started by the overlap policy
    last_missed_slot_at TIMESTAMPTZ,
    last_not_started_reason TEXT,
    created_at TIMESTAMPTZ NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL,
    deleted_at TIMESTAMPTZ
);
CREATE UNIQUE INDEX IF NOT EXISTS idx_schedules_name ON schedules (name) WHERE deleted_at IS NULL;
CREATE INDEX IF NOT EXISTS idx_schedules_wake ON schedules (wake_at)
    WHERE NOT paused AND deleted_at IS NULL AND wake_at IS NOT NULL;

CREATE TABLE IF NOT EXISTS schedule_events(
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    schedule_id TEXT NOT NULL REFERENCES schedules (id),
    at TIMESTAMPTZ NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('started', 'buffered', 'missed', 'skipped')),
    source TEXT NOT NULL CHECK (source IN ('cron', 'trigger', 'backfill')),
    first_slot_at TIMESTAMPTZ NOT NULL,
    last_slot_at TIMESTAMPTZ NOT NULL,
    slots INT NOT NULL DEFAULT 1,
    run_id TEXT,
    reason TEXT
);
CREATE INDEX IF NOT EXISTS idx_schedule_events_schedule ON schedule_events (schedule_id, id);

GRANT SELECT, INSERT, UPDATE ON schedules TO composer_ops_engine;
GRANT SELECT, INSERT ON schedule_events TO composer_ops_engine;
