-- V017: a dispatch wakes one idle worker, not every worker listening.
--
-- A NOTIFY on the shared channel reaches every listening worker: with 4 workers idle,
-- one dispatch made 4 claims of which 3 came back empty (65% of claims at W=4 in
-- bench/run.py). Here an idle worker is registered in task_waiters by its own claim
-- (composer_claim with its wake channel): the row says which queues and task names it
-- serves and the channel it listens on. A dispatch (outbox.enqueue) deletes up to one
-- waiter per task it makes available, the most recently idle first, and notifies each
-- on its own channel; only when it finds none (every worker busy, or between its
-- wake-up and its next claim) does it notify the shared channel, which every worker
-- also listens on. Wake-ups stay an optimisation: workers poll, so a waiter row of a
-- worker that died costs one dispatch at most one poll interval, and is gone once
-- used.
--
-- composer_claim registers the caller before it takes any outbox row, so a claim
-- that waits there (an enqueuer is deleting the same row and has not committed)
-- holds nothing yet; a claim that takes all it asked for has no room left and
-- withdraws its row with SKIP LOCKED (a row an enqueuer is deleting is already
-- going; taking a row FOR UPDATE needs the UPDATE grant). The table is UNLOGGED:
-- after a crash it is empty, and every worker registers again at its next claim (at
-- most one poll interval later).
CREATE UNLOGGED TABLE task_waiters (
    worker     TEXT PRIMARY KEY,
    channel    TEXT NOT NULL,
    queues     TEXT[] NOT NULL,
    task_names TEXT[],
    since      TIMESTAMPTZ NOT NULL DEFAULT NOW()
);

DROP FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT);

-- composer_claim of V013 (same steps, same rows), with p_channel: the caller's wake
-- channel, NULL for a caller that is not a listening worker (no registration).
CREATE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
                               p_claim TEXT, p_channel TEXT)
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ)
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
DECLARE
    runs TEXT[];
    ids TEXT[];
    attempts INT[];
    names TEXT[];
    leases INT[];
    queues TEXT[];
    claimed INT := 0;
BEGIN
    IF p_channel IS NOT NULL THEN
        INSERT INTO task_waiters (worker, channel, queues, task_names)
        VALUES (p_owner, p_channel, p_queues, p_names)
        ON CONFLICT (worker) DO NOTHING;
    END IF;
    WITH picked AS (
        DELETE FROM task_outbox o
         USING (SELECT id FROM task_outbox
                 WHERE queue = ANY(p_queues) AND available_at <= NOW()
                   AND (p_names IS NULL OR task_name = ANY(p_names))
                 ORDER BY available_at, id
                 LIMIT p_limit
                   FOR UPDATE SKIP LOCKED) s
         WHERE o.id = s.id
        RETURNING o.run_id, o.task_id, o.attempt, o.task_name, o.lease_s, o.queue)
    SELECT array_agg(picked.run_id), array_agg(picked.task_id), array_agg(picked.attempt),
           array_agg(picked.task_name), array_agg(picked.lease_s), array_agg(picked.queue)
      INTO runs, ids, attempts, names, leases, queues
      FROM picked;
    IF runs IS NOT NULL THEN
        RETURN QUERY
            WITH claimed AS (
                UPDATE task_instances t
                   SET state = 'RUNNING', lease_owner = p_owner,
                       lease_expires_at = NOW() + make_interval(secs => p.lease_s),
                       started_at = NOW(), updated_at = NOW()
                  FROM unnest(runs, ids, attempts, names, leases, queues)
                       AS p(run_id, task_id, attempt, task_name, lease_s, queue)
                 WHERE t.run_id = ANY(runs)
                   AND t.run_id = p.run_id AND t.id = p.task_id AND t.attempt = p.attempt
                   AND t.state IN ('PENDING', 'QUEUED')
                   AND NOT EXISTS (SELECT 1 FROM workflow_runs r
                                    WHERE r.id = ANY(runs) AND r.id = t.run_id AND r.deleted_at IS NOT NULL)
                RETURNING t.run_id, t.id AS task_id, t.node_id, t.attempt, p.task_name, p.queue,
                          t.input_json AS input, p.lease_s, t.lease_owner, t.lease_expires_at
            ), noted AS (
                INSERT INTO run_history (run_id, kind, node_id, task_id, attempt, worker, request, detail)
                SELECT c.run_id, 'claimed', c.node_id, c.task_id, c.attempt, c.lease_owner, p_claim,
                       jsonb_build_object('task', c.task_name, 'lease_s', c.lease_s)
                  FROM claimed c)
            SELECT c.run_id, c.task_id, c.node_id, c.attempt, c.task_name, c.queue, c.input, c.lease_s,
                   c.lease_owner, c.lease_expires_at
              FROM claimed c;
        GET DIAGNOSTICS claimed = ROW_COUNT;
    END IF;
    IF p_channel IS NOT NULL AND claimed >= p_limit THEN
        DELETE FROM task_waiters w
         WHERE w.worker = (SELECT x.worker FROM task_waiters x WHERE x.worker = p_owner FOR UPDATE SKIP LOCKED);
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT) TO composer_ops_engine;
GRANT SELECT, INSERT, UPDATE, DELETE ON task_waiters TO composer_ops_engine;
GRANT SELECT ON task_waiters TO composer_ops_reader;
