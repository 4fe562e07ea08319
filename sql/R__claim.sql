-- The claim: a worker takes tasks from the outbox and leases them. A repeatable file
-- (docs/architecture.md, "where new code goes"): the claim's whole SQL is here.
--
-- composer_claim runs in one call (one statement for the caller, one transaction):
--   0. it takes a transaction-scoped advisory lock on its claim ID: a claim retried after
--      a lost acknowledgement takes the same lock before it looks for its 'claimed'
--      history rows, so it waits for a first attempt still executing or committing and
--      then finds what that attempt claimed (docs/reliability.md); the retry also fences
--      the claim ID (claim_fences), and an attempt that gets the lock after a fence
--      committed (its statement reached the server late) claims nothing;
--   1. a listening worker registers itself in task_waiters (its queues, task names and
--      wake channel) before it takes any outbox row, so a claim that waits there (an
--      enqueuer is deleting the same row and has not committed) holds nothing yet;
--   2. it deletes up to p_limit available outbox rows of its queues, oldest first,
--      FOR UPDATE SKIP LOCKED;
--   3. it moves their tasks to RUNNING with a lease, fenced on the attempt and on the
--      task still being PENDING or QUEUED, and writes each claimed task's run-history
--      row (marked with the claim's ID, which a retried claim looks up) in the same
--      statement. A task of a soft-deleted run is not claimed (its outbox row is
--      consumed all the same).
-- The task update names the run IDs as a constant array, and plan_cache_mode =
-- force_custom_plan makes it planned with the array's value: the planner keeps only the
-- partitions the run IDs fall in and locks only those months (a generic, cached plan
-- would lock every month's partitions and indexes before pruning, PostgreSQL 15 to 18;
-- tests/integration/test_claim_months.py). The check on workflow_runs prunes the same way.
--
-- A dispatch (repo/outbox.py, enqueue) deletes up to one waiter per task it makes
-- available, the most recently idle first, and notifies each on its own channel; when
-- it wakes fewer workers than tasks, or one that does not serve every task, it also
-- notifies the shared channel. Wake-ups are an optimisation: workers poll, so a waiter
-- row of a dead worker costs one dispatch at most one poll interval. task_waiters is
-- UNLOGGED: after a crash it is empty and every worker registers again at its next claim.

-- The six-argument claim: p_limit tasks at most; a claim that takes all it asked for
-- has no room left and withdraws its registration with SKIP LOCKED (a row an enqueuer
-- is deleting is already going). p_channel NULL: a caller that is not a listening
-- worker (no registration).
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
    -- lock_claim), waits for this attempt and then sees what it did. Two int4 keys: a
    -- space of their own, apart from one-bigint keys such as hashtext('composer_partitions').
    PERFORM pg_advisory_xact_lock(hashtext('composer_claim'), hashtext(p_claim));
    -- A new statement, so a new snapshot: it sees a fence its retry committed while
    -- this attempt waited for the lock, or before this attempt reached the server.
    IF EXISTS (SELECT 1 FROM claim_fences f WHERE f.claim = p_claim) THEN
        RETURN;
    END IF;
    IF p_channel IS NOT NULL THEN
        INSERT INTO task_waiters (worker, channel, queues, task_names)
        VALUES (p_owner, p_channel, p_queues, p_names)
        ON CONFLICT (worker) DO NOTHING;
    END IF;
    -- The pick runs once (MATERIALIZED): as a subquery the planner could rescan it on
    -- the inner side of a nested loop (statistics of a drained outbox: one page, no rows),
    -- each run skipping the rows this statement had deleted, and take every ready row.
    WITH s AS MATERIALIZED (
        SELECT id FROM task_outbox
         WHERE queue = ANY(p_queues) AND available_at <= NOW()
           AND (p_names IS NULL OR task_name = ANY(p_names))
         ORDER BY available_at, id
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    ), picked AS (
        DELETE FROM task_outbox o
         USING s
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

-- The claim workers make: p_limit tasks (the wake-ups the worker had on its own
-- channel), while p_room, its free slots, decides its registration: a claim that takes
-- fewer than p_room leaves the worker registered (the six-argument claim withdraws it
-- once it takes p_limit, so it is written again here, in the same transaction), and the
-- worker is woken by the next dispatch. The six-argument form is this with p_room = p_limit.
CREATE OR REPLACE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
                               p_claim TEXT, p_channel TEXT, p_room INT)
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ)
LANGUAGE plpgsql
AS $$
DECLARE
    claimed INT;
BEGIN
    RETURN QUERY SELECT * FROM composer_claim(p_queues, p_names, p_owner, p_limit, p_claim, p_channel);
    GET DIAGNOSTICS claimed = ROW_COUNT;
    -- A row still visible here is being deleted by a dispatch that has not committed: it
    -- wakes this worker when it does. Inserting then would wait for that dispatch while
    -- this claim holds outbox and task rows; the NOT EXISTS keeps the claim from waiting.
    IF p_channel IS NOT NULL AND claimed >= p_limit AND claimed < p_room THEN
        INSERT INTO task_waiters (worker, channel, queues, task_names)
        SELECT p_owner, p_channel, p_queues, p_names
         WHERE NOT EXISTS (SELECT 1 FROM task_waiters x WHERE x.worker = p_owner)
        ON CONFLICT (worker) DO NOTHING;
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT) TO composer_ops_engine;
REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT) TO composer_ops_engine;
