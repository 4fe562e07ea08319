-- Dispatch: outbox rows written and idle workers woken. A repeatable file
-- (docs/architecture.md, "where new code goes").
--
-- composer_enqueue(rows, now): write the outbox rows in ``rows`` (one JSON array of
-- objects, the recordset repo/outbox.py builds: q queue, r run, t task, a attempt, n task
-- name, l lease_s, av available_at, p priority, m max_run_s, w schedule_to_start_s, ck/cl
-- concurrency key and limit, rk/rp/rb rate key, per second and burst), available from
-- ``now`` unless a retry's backoff says later, and wake one idle worker per row. Called
-- by composer_apply (sql/R__apply.sql), the one write of an event; repo/outbox.py says
-- how waiters are picked and when the shared channel is notified.
CREATE OR REPLACE FUNCTION composer_enqueue(rows JSONB, now TIMESTAMPTZ) RETURNS VOID
LANGUAGE plpgsql AS $$
DECLARE
    notified BIGINT;
BEGIN
        WITH ins AS (
            INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at, created_at,
                                     priority, max_run_s, start_by, ckey, climit, rkey, rate_per_s, rate_burst)
            SELECT q, r, t, a, n, l, COALESCE(av, composer_enqueue.now), composer_enqueue.now, COALESCE(p, 0), m,
                   COALESCE(av, composer_enqueue.now) + make_interval(secs => w), ck, cl, rk, rp, rb
              FROM jsonb_to_recordset(composer_enqueue.rows) AS d(q text, r text, t text, a int4, n text, l int4,
                                                           av timestamptz, p int2, m int4, w float8, ck text,
                                                           cl int4, rk text, rp float8, rb int4)
            RETURNING queue, task_name
        ), woken AS (
            DELETE FROM task_waiters w
             USING (SELECT x.worker FROM task_waiters x
                     WHERE EXISTS (SELECT 1 FROM ins
                                    WHERE ins.queue = ANY(x.queues)
                                      AND (x.task_names IS NULL OR ins.task_name = ANY(x.task_names)))
                     ORDER BY x.since DESC
                     LIMIT (SELECT count(*) FROM ins)
                       FOR UPDATE SKIP LOCKED) s
             WHERE w.worker = s.worker
            RETURNING w.channel, w.queues, w.task_names)
        SELECT count(*) INTO notified FROM (
        SELECT pg_notify(channel, queues[1]) FROM woken
        UNION ALL
        SELECT pg_notify('composer_tasks', q.queue)
          FROM (SELECT DISTINCT queue FROM ins ORDER BY queue) q
         WHERE (SELECT count(*) FROM woken) < (SELECT count(*) FROM ins)
            OR EXISTS (SELECT 1 FROM woken w, ins i
                        WHERE NOT (i.queue = ANY(w.queues)
                                   AND (w.task_names IS NULL OR i.task_name = ANY(w.task_names))))) n;
END;
$$;
