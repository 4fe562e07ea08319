-- Citus only, in place of sql/R__dispatch.sql: the dispatch's outbox rows, written on
-- their run's node (sql/citus/V016 distributes the outbox with the runs). Each row is
-- its own INSERT ... VALUES naming the run, routed to the run's shard (an INSERT ...
-- SELECT from the document is planned through the coordinator and commits with
-- two-phase commit). No waiter registers on Citus: the engine notifies the shared
-- channel in the event's transaction (composer_ops/repo/outbox.py, announce); the poll
-- stays the safety net.
-- The rows' groups (p_gq, p_gn, p_gc, p_ords: sql/R__dispatch.sql) hand rows to
-- waiters; with none registered here, they are not read.
DROP FUNCTION IF EXISTS composer_enqueue(JSONB, TIMESTAMPTZ);
DROP FUNCTION IF EXISTS composer_enqueue(JSONB, TIMESTAMPTZ, INTERVAL);
CREATE OR REPLACE FUNCTION composer_enqueue(p_rows JSONB, p_now TIMESTAMPTZ, p_shift INTERVAL, p_gq TEXT[],
                                            p_gn TEXT[], p_gc INT[], p_ords INT[])
RETURNS VOID
LANGUAGE plpgsql
AS $$
DECLARE
    d RECORD;
BEGIN
    FOR d IN SELECT * FROM jsonb_to_recordset(p_rows) AS x(q text, r text, t text, a int4, n text, l int4,
                                                          av timestamptz, p int2, m int4, w float8, ck text,
                                                          cl int4, rk text, rp float8, rb int4) LOOP
        INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at, created_at,
                                 priority, max_run_s, start_by, ckey, climit, rkey, rate_per_s, rate_burst)
        VALUES (d.q, d.r, d.t, d.a, d.n, d.l, COALESCE(d.av + p_shift, p_now), p_now, COALESCE(d.p, 0), d.m,
                COALESCE(d.av + p_shift, p_now) + make_interval(secs => d.w), d.ck, d.cl, d.rk, d.rp, d.rb);
    END LOOP;
END;
$$;

REVOKE ALL ON FUNCTION composer_enqueue(JSONB, TIMESTAMPTZ, INTERVAL, TEXT[], TEXT[], INT[], INT[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_enqueue(JSONB, TIMESTAMPTZ, INTERVAL, TEXT[], TEXT[], INT[], INT[])
    TO composer_ops_engine;
