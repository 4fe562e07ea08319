-- V018: who did what to the data (operator_audit), which workers exist (workers), where
-- detached months are kept (composer_detached), and the one way the engine removes tasks:
-- those a retry runs again (composer_reset_tasks).
--
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
    request TEXT
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

-- The engine role writes both (bulk cancel, retry and delete run as the engine); the
-- owner writes the partition actions' rows; the reader role reads them for reports.
GRANT SELECT, INSERT ON operator_audit TO composer_ops_engine;
GRANT SELECT, INSERT, UPDATE ON workers TO composer_ops_engine;
GRANT SELECT ON operator_audit, workers TO composer_ops_reader;

-- `composer-ops partitions detach` keeps a month it takes out of the run tables as
-- standalone tables under their own names in this schema (pg_partman's retention_keep_table
-- with a retention schema), out of the way of the partitions the engine creates.
CREATE SCHEMA IF NOT EXISTS composer_detached;
GRANT USAGE ON SCHEMA composer_detached TO composer_ops_reader;

-- A retry (Engine.retry, `composer-ops runs retry`) removes the finished tasks of the
-- nodes that run again, so that the state machine creates them anew. The engine role
-- may not delete tasks; it may call this function, which runs as its owner and removes
-- only finished tasks of a run that is itself finished (FAILED or CANCELLED: the retry
-- removes them before it reopens the run, under the run's lock). Returns how many it
-- removed; the caller rolls back unless that is every task it named. Like
-- composer_ensure_partitions (V006), its search_path is fixed.
CREATE OR REPLACE FUNCTION composer_reset_tasks(run TEXT, task_ids TEXT[]) RETURNS INT
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    removed INT;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM workflow_runs
                    WHERE id = run AND status IN ('FAILED', 'CANCELLED') AND deleted_at IS NULL) THEN
        RETURN 0;
    END IF;
    DELETE FROM task_instances
     WHERE run_id = run AND id = ANY(task_ids) AND state IN ('COMPLETED', 'FAILED', 'SKIPPED', 'CANCELLED');
    GET DIAGNOSTICS removed = ROW_COUNT;
    RETURN removed;
END;
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION composer_reset_tasks(TEXT, TEXT[]) SET search_path = %I, pg_temp',
                   current_schema());
END;
$$;

REVOKE ALL ON FUNCTION composer_reset_tasks(TEXT, TEXT[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_reset_tasks(TEXT, TEXT[]) TO composer_ops_engine;
