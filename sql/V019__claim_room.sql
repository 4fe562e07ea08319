-- V019: a woken worker claims what it was woken for, and stays registered while it has room.
--
-- With one worker woken per dispatch (V017), a woken worker still claimed as many tasks as
-- it had free slots: the first of two workers woken by two dispatches took both tasks, and
-- the second one's claim came back empty (42% of the claims made after a wake-up on the
-- worker's own channel alone: 4 workers of 4 slots, the sustained 1-task workload of
-- bench/run.py). A worker now claims p_limit tasks, the wake-ups it had on its own
-- channel, while p_room, its free slots, decides its registration: a claim that takes
-- fewer than p_room leaves the worker registered (the six-argument claim withdraws it once
-- it takes p_limit, so it is written again here, in the same transaction), and the worker
-- is woken by the next dispatch. A dispatch that makes more tasks available than it wakes
-- registered workers, or wakes one that does not serve every task, also notifies the
-- shared channel (repo/outbox.py, enqueue), and a worker told there claims as many as it
-- has room for, so no task is left for a poll. The six-argument function stays, with its
-- own meaning (p_room = p_limit), for engines that call it; during a rolling deploy a
-- dispatch by an engine of the previous version tells the shared channel only when it
-- wakes nobody, so a new worker woken once for several tasks leaves the rest for its poll.
CREATE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
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

REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT) TO composer_ops_engine;
