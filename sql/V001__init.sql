-- V001: the baseline of 0.1.0. The seed's schema (shared/seed/storage-page.txt) first,
-- in its order and shape, then what the engine added to it. The pre-release migrations
-- (V002 to V020 and sql/citus) were squashed into it; a database they built must be
-- re-created (`composer-ops migrate` refuses it).
--
-- Tables, columns, indexes, roles and grants live in V files, which never change once
-- shipped; the current body of every function lives in one repeatable file
-- (sql/R__*.sql), which `composer-ops migrate` applies after the V files
-- (docs/architecture.md, "where new code goes"). The seed's three functions are there:
-- composer_uuid7_bound and composer_ensure_partitions in R__partitions.sql, which ends
-- with the seed's initial `SELECT composer_ensure_partitions(3)`, and
-- composer_drop_partitions in R__retention.sql.

-- Definitions are versioned. The primary key is (id, version), and a deployed flag
-- marks the version new runs use. Definitions are never physically deleted
-- (deleted_at instead), so a run that started on a version can always load it and finish.
CREATE TABLE IF NOT EXISTS workflow_definitions(
    id TEXT NOT NULL,
    name TEXT NOT NULL,
    version INT NOT NULL,
    spec_json JSONB NOT NULL,
    created_by TEXT NOT NULL,
    enabled BOOLEAN NOT NULL DEFAULT true,
    webhook_url TEXT,
    deployed BOOLEAN NOT NULL DEFAULT false,
    deployed_at TIMESTAMPTZ,
    deleted_at TIMESTAMPTZ,
    created_at TIMESTAMPTZ DEFAULT NOW(),
    PRIMARY KEY (id, version)
);

-- Run data is range-partitioned by month on the run ID. A UUIDv7's first 48 bits are
-- a millisecond timestamp, so its text form sorts by creation time and the run ID
-- alone tells PostgreSQL which month's partition to look in.
-- COLLATE "C" makes text comparison plain byte order, so the range bounds behave
-- exactly like the UUID's time ordering.
CREATE TABLE IF NOT EXISTS workflow_runs(
    id TEXT COLLATE "C" NOT NULL,
    workflow_definition_id TEXT NOT NULL,
    workflow_version INT NOT NULL,
    status TEXT NOT NULL DEFAULT 'PENDING',
    input_json JSONB,
    context_json JSONB, -- {input, config} only; task outputs live in task_instances
    error_json JSONB,
    deleted_at TIMESTAMPTZ,
    created_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    completed_at TIMESTAMPTZ,
    PRIMARY KEY (id),
    FOREIGN KEY (workflow_definition_id, workflow_version) REFERENCES workflow_definitions(id, version)
) PARTITION BY RANGE (id);

-- task_instances is the hottest table: every state change of every task updates a row
-- here. Its partition key is run_id, so a task lives in the same month's partition as its run.
CREATE TABLE IF NOT EXISTS task_instances(
    id TEXT COLLATE "C" NOT NULL,
    run_id TEXT COLLATE "C" NOT NULL,
    node_id TEXT NOT NULL,
    node_type TEXT NOT NULL,
    queue TEXT,                -- worker queue the task is dispatched on
    state TEXT NOT NULL DEFAULT 'PENDING',
    attempt INT NOT NULL DEFAULT 0,
    input_json JSONB,
    output_json JSONB,
    last_error JSONB,
    branches TEXT[],           -- SWITCH: successors it selected
    wake_at TIMESTAMPTZ,       -- WAITING: when the timer fires (WAIT) or times out (WAIT_FOR_EVENT)
    event_name TEXT,           -- WAITING on WAIT_FOR_EVENT: the event that resolves it
    scheduled_at TIMESTAMPTZ,
    started_at TIMESTAMPTZ,
    finished_at TIMESTAMPTZ,
    completed_at TIMESTAMPTZ,
    created_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    lease_owner TEXT,
    lease_expires_at TIMESTAMPTZ,
    PRIMARY KEY (run_id, id),
    FOREIGN KEY (run_id) REFERENCES workflow_runs(id) ON DELETE CASCADE
) PARTITION BY RANGE (run_id);

-- Keep task_instances indexes minimal: every state change rewrites each index,
-- and indexing the state/lease columns would prevent HOT updates.
-- (run_id, node_id) also serves every lookup by run_id.
-- The unique index is a safety net: even if two decisions somehow raced, the
-- database would refuse a second task for the same node.
CREATE UNIQUE INDEX IF NOT EXISTS idx_task_instances_run_node ON task_instances(run_id, node_id);
-- Partial index for counting a run's active tasks: only rows in active states,
-- which are a small fraction of the table once workflows complete.
CREATE INDEX IF NOT EXISTS idx_task_instances_run_active
    ON task_instances (run_id)
    WHERE state IN ('PENDING', 'RUNNING', 'QUEUED', 'WAITING');
-- Lease sweeper: RUNNING tasks (few: bounded by the workers' total concurrency), read
-- through this index and filtered on lease_expires_at. It replaces the seed's
-- idx_task_instances_running_lease ON (lease_expires_at) WHERE state = 'RUNNING': a
-- heartbeat changes exactly lease_expires_at, so with the seed's index no heartbeat
-- was a HOT update (tests/integration/test_hot_updates.py); run_id never changes.
CREATE INDEX IF NOT EXISTS idx_task_instances_running
    ON task_instances (run_id)
    WHERE state = 'RUNNING';
-- Timer: find WAITING tasks that are due.
CREATE INDEX IF NOT EXISTS idx_task_instances_wake
    ON task_instances (wake_at)
    WHERE state = 'WAITING' AND wake_at IS NOT NULL;

-- Events signalled to a run before a WAIT_FOR_EVENT node was waiting for them.
CREATE TABLE IF NOT EXISTS workflow_events(
    id TEXT COLLATE "C" NOT NULL,
    run_id TEXT COLLATE "C" NOT NULL,
    name TEXT NOT NULL,
    payload JSONB,
    created_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    consumed_at TIMESTAMPTZ,
    PRIMARY KEY (run_id, id),
    FOREIGN KEY (run_id) REFERENCES workflow_runs(id) ON DELETE CASCADE
) PARTITION BY RANGE (run_id);

CREATE INDEX IF NOT EXISTS idx_workflow_events_pending
    ON workflow_events (run_id, name, created_at)
    WHERE consumed_at IS NULL;

-- ---------------------------------------------------------------------------------
-- After the seed.

-- The run's result: the outputs of the nodes nothing depends on, keyed by node id
-- (context_json stays {input, config}).
ALTER TABLE workflow_runs ADD COLUMN IF NOT EXISTS output_json JSONB;

-- How many of a task's attempts ended in an expired lease. attempt counts every
-- re-queue; the retry policy counts only handler failures (attempt - lease_expiries),
-- and a task fails once its expiries pass the node's max_lease_expiries.
ALTER TABLE task_instances ADD COLUMN IF NOT EXISTS lease_expiries INT NOT NULL DEFAULT 0;

-- Creating or re-queuing a TASK writes a task_outbox row in the same transaction.
-- A worker claims with one statement that deletes the row (FOR UPDATE SKIP LOCKED)
-- and moves the task to RUNNING, fenced on attempt. The outbox is a queue: rows are
-- inserted and deleted, never updated, so it stays small and is not partitioned.
CREATE TABLE IF NOT EXISTS task_outbox(
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue TEXT NOT NULL,
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
-- The coordinator deletes deliveries delivered or given up more than N days ago
-- (--webhook-keep-days, 7 by default), in small batches, oldest first, through this
-- partial index, which holds only finished deliveries.
CREATE INDEX IF NOT EXISTS idx_webhook_deliveries_done
    ON webhook_deliveries ((COALESCE(delivered_at, gave_up_at)))
    WHERE delivered_at IS NOT NULL OR gave_up_at IS NOT NULL;

-- Every month retention dropped, with the request that dropped it, written in the
-- drop's transaction: a drop retried after its COMMIT acknowledgement was lost finds
-- its own record and reports what it dropped (composer_ops/repo/retention.py).
CREATE TABLE IF NOT EXISTS retention_drops(
    month TEXT NOT NULL,                 -- YYYYMM
    partitions TEXT[] NOT NULL,
    rows BIGINT NOT NULL,                -- the plan's figures when it was dropped
    bytes BIGINT NOT NULL,
    cutoff TIMESTAMPTZ NOT NULL,
    request_id TEXT NOT NULL,            -- the drop call (retries of one call share it)
    dropped_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (month, dropped_at)
);
CREATE INDEX IF NOT EXISTS idx_retention_drops_request ON retention_drops (request_id);

-- The history of every run.
--
-- run_history holds what a run's own rows do not show: every claim of a task (with the
-- worker), a lease a worker found lost, a lease that expired, a failure and whether it
-- was re-queued, a completion, a signal (resolving a node, buffered, consumed later by
-- a node, refused), a timer, a cancel, a task a worker abandoned at shutdown, and
-- operator actions. Each row is written in the same transaction as the change it
-- describes, mostly by the same statement. It is partitioned like the run tables, by
-- run ID, so a run's history lives in its run's month and retention drops it with the
-- month. `seq` orders the rows of a run (several rows can share one transaction's `at`).
--
-- `request` makes every write that may be retried idempotent. Each call of the engine's
-- API mints a request ID once and keeps it across the retries of its transaction; the
-- rows the call writes carry it. A retry (only a retry) first looks for rows of its
-- request under the run's lock: if the attempt whose COMMIT acknowledgement was lost
-- did commit, they are there (they committed with it), and the retry returns the
-- original outcome instead of applying the change again. A signal sent with the
-- caller's idempotency key uses 'key:' || key as its request, so two calls with one
-- key resolve at most one node. The claim, which takes no run lock, marks its rows
-- with its claim ID the same way.
--
-- No foreign key to workflow_runs, unlike the other run tables: the claim writes a
-- history row without taking the run's lock, and a foreign key check would lock the
-- run row FOR KEY SHARE, which waits behind any event holding the run lock FOR UPDATE.
-- Rows are only ever inserted (by the engine) and dropped with their month. `seq` is a
-- plain sequence default (not an identity column), so that a partition created apart
-- and attached (CREATE TABLE ... LIKE ... INCLUDING DEFAULTS) numbers its rows the same.
CREATE SEQUENCE IF NOT EXISTS run_history_seq AS BIGINT;
CREATE TABLE IF NOT EXISTS run_history(
    run_id TEXT COLLATE "C" NOT NULL,
    seq BIGINT NOT NULL DEFAULT nextval('run_history_seq'),
    at TIMESTAMPTZ NOT NULL DEFAULT NOW(),  -- the database clock of the change's transaction
    kind TEXT NOT NULL,                      -- claimed, completed, failed, lease_expired, lease_lost, ...
    node_id TEXT,
    task_id TEXT COLLATE "C",
    attempt INT,                             -- the attempt the row is about
    worker TEXT,                             -- the worker (lease owner) concerned, when there is one
    request TEXT,                            -- the API call that wrote it (see above)
    detail JSONB,                            -- the error, the signal, what followed (re-queued, run finished)
    PRIMARY KEY (run_id, seq)
) PARTITION BY RANGE (run_id);

-- Idle workers, registered by their own claims (sql/R__claim.sql says how dispatches
-- use them). UNLOGGED: after a crash it is empty, and every worker registers again at
-- its next claim.
CREATE UNLOGGED TABLE task_waiters (
    worker     TEXT PRIMARY KEY,
    channel    TEXT NOT NULL,
    queues     TEXT[] NOT NULL,
    task_names TEXT[],
    since      TIMESTAMPTZ NOT NULL DEFAULT NOW()
);

-- operator_audit: one row per operator action (a partition month archived, dropped,
-- detached or restored; a batch of runs cancelled; a run retried or deleted), written
-- in the same transaction as the change, so a row exists exactly when the change
-- committed and a dry run writes none. The database fills in who and from where
-- (session_user, current_user, the client address it sees); the command fills in the
-- command line (secrets removed), the host it ran on, what it acted on and counts.
-- `request` ties the rows of one command together (a bulk cancel writes one row per
-- chunk) and lets a retried transaction find its own earlier commit. The table is
-- not partitioned and retention never touches it: it outlives the months it describes.
CREATE TABLE IF NOT EXISTS operator_audit(
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at TIMESTAMPTZ NOT NULL DEFAULT now(),
    action TEXT NOT NULL,                 -- 'partitions drop', 'runs cancel', ...
    target TEXT,                          -- the month, the run, or the selection acted on
    counts JSONB NOT NULL DEFAULT '{}',   -- {"runs": 12}, {"rows": 4096, "months": 1}, ...
    detail JSONB,                         -- what else the action reports (files, run IDs, errors)
    command TEXT,                         -- the command line, secrets removed
    client_host TEXT,                     -- the host the command ran on, as it says
    client_addr TEXT NOT NULL DEFAULT COALESCE(host(inet_client_addr()), 'local'),  -- as the server sees it
    login_role TEXT NOT NULL DEFAULT session_user,
    db_role TEXT NOT NULL DEFAULT current_user,                                       -- whose privileges acted
    request TEXT,
    command_id TEXT                       -- shared by every row one command wrote (audit list: one line)
);
CREATE INDEX IF NOT EXISTS idx_operator_audit_at ON operator_audit (at);
CREATE INDEX IF NOT EXISTS idx_operator_audit_request ON operator_audit (request) WHERE request IS NOT NULL;

-- workers: every Worker registers itself when it starts, refreshes last_seen_at once
-- per heartbeat_s (one small HOT update per interval, whatever its task rate), and
-- sets stopped_at when it stops cleanly. A worker not seen for three intervals and
-- not stopped is dead; the leases it held name it (task_instances.lease_owner), so
-- the tasks a dead worker left behind can be listed.
CREATE TABLE IF NOT EXISTS workers(
    id TEXT PRIMARY KEY,                  -- the lease owner its claims write
    host TEXT NOT NULL,
    pid INT NOT NULL,
    queues TEXT[] NOT NULL,
    concurrency INT NOT NULL,
    heartbeat_s FLOAT8 NOT NULL,
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_seen_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    stopped_at TIMESTAMPTZ
) WITH (fillfactor = 50);

-- `composer-ops partitions detach` keeps a month it takes out of the run tables as
-- standalone tables under their own names in this schema (pg_partman's retention_keep_table
-- with a retention schema), out of the way of the partitions the engine creates.
CREATE SCHEMA IF NOT EXISTS composer_detached;

-- ---------------------------------------------------------------------------------
-- Roles and privileges (docs/security.md). Three roles use a Composer database:
--   the owner             runs migrations and owns every table and function; the only
--                         role that can drop or detach partitions, back-fill past months
--                         (composer_ensure_partitions_from) or repair bounds;
--   composer_ops_engine   coordinators, workers and the applications that deploy,
--                         start, signal and cancel: reads and writes rows of the
--                         engine's tables, and may call composer_ensure_partitions,
--                         composer_claim and composer_reset_tasks (the R files grant them);
--   composer_ops_reader   notebooks and reports: CONNECT, USAGE and SELECT only,
--                         including on partitions created later (default privileges).
--
-- Roles are cluster-wide and many databases of one cluster run this file (every test
-- database, staging next to production), so each is created only once, tolerating
-- another migrator creating it at the same moment; grants are per database. NOLOGIN:
-- people, report jobs and deployments log in as their own roles and are granted these.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'composer_ops_reader') THEN
        CREATE ROLE composer_ops_reader NOLOGIN;
    END IF;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN
        NULL;
    WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'cannot create role composer_ops_reader: %', SQLERRM
            USING HINT = 'create it once as a role with CREATEROLE (CREATE ROLE composer_ops_reader NOLOGIN), '
                         'then run the migration again';
END;
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'composer_ops_engine') THEN
        CREATE ROLE composer_ops_engine NOLOGIN;
    END IF;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN
        NULL;
    WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'cannot create role composer_ops_engine: %', SQLERRM
            USING HINT = 'create it once as a role with CREATEROLE (CREATE ROLE composer_ops_engine NOLOGIN), '
                         'then run the migration again';
END;
$$;

DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO composer_ops_reader', current_database());
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO composer_ops_reader', current_schema());
    -- Existing tables, then everything the owner creates later (the partitions
    -- composer_ensure_partitions creates as the owner).
    EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA %I TO composer_ops_reader', current_schema());
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT ON TABLES TO composer_ops_reader',
                   current_schema());
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO composer_ops_engine', current_database());
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO composer_ops_engine', current_schema());
END;
$$;
GRANT USAGE ON SCHEMA composer_detached TO composer_ops_reader;

-- Exactly the statements the engine runs (composer_ops/repo): definitions are
-- soft-deleted, runs and their rows leave only with their partition (the engine role
-- reads and updates a run's month partitions by name: composer_ensure_partitions_from
-- grants that on each), the outbox and the waiters are queues (a claim's FOR UPDATE
-- needs UPDATE), run history and the audit are appended to (bulk cancel, retry and
-- delete run as the engine), workers register themselves, finished webhook
-- deliveries are pruned.
GRANT SELECT, INSERT, UPDATE ON workflow_definitions, workflow_runs, task_instances, workflow_events,
    webhook_deliveries TO composer_ops_engine;
GRANT SELECT, INSERT, UPDATE, DELETE ON task_outbox, task_waiters TO composer_ops_engine;
GRANT DELETE ON webhook_deliveries TO composer_ops_engine;
GRANT SELECT, INSERT ON run_history, operator_audit TO composer_ops_engine;
GRANT USAGE ON SEQUENCE run_history_seq TO composer_ops_engine;
GRANT SELECT, INSERT, UPDATE ON workers TO composer_ops_engine;

-- The partitions of the run tables, and the initial `SELECT composer_ensure_partitions(3)`
-- of the seed, come from sql/R__partitions.sql, applied after this file.
