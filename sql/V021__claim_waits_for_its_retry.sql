-- V021: a claim's retry waits for the attempt it retries.
--
-- A claim is one statement with no run lock; a retry after a lost acknowledgement first
-- looks for the 'claimed' history rows of its claim ID (repo/outbox.py, claimed_by). When
-- the first attempt was still executing, or still committing (a COMMIT waiting on fsync or
-- a synchronous standby), as the retry looked, the retry found nothing, claimed other tasks
-- and returned them, and the first attempt then committed: its tasks were RUNNING, leased
-- to a worker that never learnt of them, and their lease expiry counted against
-- max_lease_expiries (with 0, the run failed without any handler having run).
--
-- The claim now takes a transaction-scoped advisory lock keyed on its claim ID as its first
-- step (two int4 keys: a space of their own, apart from the one-bigint keys such as
-- hashtext('composer_partitions')). A retry takes the same lock, in its own transaction,
-- before it looks: it waits until the first attempt has committed (then finds its rows and
-- returns them) or rolled back (then finds nothing and claims). A first claim takes a lock
-- no one holds: one lock, no wait. Two claim IDs whose hashes collide only make one claim
-- wait for the other's short transaction.
--
-- The body of V017's six-argument function (which the seven-argument one of V019 calls),
-- the lock added; same signature, grants and settings.
CREATE OR REPLACE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
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
    -- First, before anything else: held until this claim commits or rolls back, so a
    -- retry of the same claim, which takes it before it looks (repo/outbox.py,
    -- lock_claim), waits for this attempt and then sees what it did.
    PERFORM pg_advisory_xact_lock(hashtext('composer_claim'), hashtext(p_claim));
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

-- CREATE OR REPLACE kept the grants: EXECUTE for composer_ops_engine only (V017).
