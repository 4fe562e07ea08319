-- The dispatch: outbox rows written and idle workers woken for them. A repeatable file
-- (docs/architecture.md, "where new code goes"): the dispatch's whole SQL is here; the
-- claim, which registers the idle workers, is sql/R__claim.sql.
--
-- A listening worker's claim registers it in task_waiters with its free slots after the
-- claim (`slots`), and with how many wake-ups handed to it it had taken up (`seen`, a
-- total; `promised` is the total handed out). A waiter can take
-- slots - (promised - seen) more wake-ups: what it has room for, less the wake-ups on
-- their way to it. composer_enqueue takes waiters for the rows, then writes the rows. It
-- takes them the most recently registered first (a killed worker's row stops being
-- refreshed and drifts to the back), each FOR UPDATE SKIP LOCKED (a waiter another dispatch holds is skipped),
-- one at a time and only as many as it needs: each takes up to what it can, of the rows
-- it serves (queue and task name). Each waiter taken gets one notification on its own
-- channel, whose payload is its new `promised` total; the worker claims up to
-- (that total - the wake-ups it took up before).
--
-- Rows no waiter had room for go to busy workers, whose next report claims its task
-- with its event (engine/worker.py): waiters registered with no room left, serving them
-- and handed at most one wake-up beyond their room so far, the least over-promised
-- first, then the most recently registered, are taken FOR UPDATE SKIP LOCKED, one row
-- each, with one notification as above (their new `promised` total); such wake-ups are
-- claimed as the worker's slots free. At most two beyond its room: a worker killed while
-- busy (its row outlives it), stopping, or running long handlers holds back two rows at
-- most, which `composer_uncovered` (sql/R__claim.sql) counts as covered. One row still
-- left (every such waiter held by a transaction not yet committed, its claim writing its
-- registration or another dispatch, at its two, or handed one by this dispatch) is told
-- to the least over-promised waiter serving it, then the most recently registered, on
-- its own channel with an empty payload: no wake-up
-- handed (read without locks), it claims all it has room for, as the shared channel's
-- word makes a worker claim; a busy worker's next report claims. So a dispatch
-- wakes one worker per row, where telling every worker would wake them all for one
-- task: at four busy workers, 0.33 to 0.36 of claims came back empty
-- (docs/performance-log.md, "Wake-ups handed to busy workers").
--
-- The shared channel (composer_tasks, every worker listens and claims all it has room
-- for) is notified, once per queue, for the rows left beyond that (a backlog larger than
-- the workers registered take: all claim, at full concurrency), and for every queue when
-- a waiter taken does not serve every row written, as its claims may take a row another
-- was woken for (still so with the rows handed to their workers, below: a claim takes
-- such a row after its first second ready, or when that worker has no wake-up to take up).
--
-- Each row handed to a waiter (either pass, or told) and ready now is written with it
-- (task_outbox.handed_to, sql/V018; a row ready later, a retry's backoff, with none): a
-- claim a worker makes because it was woken leaves rows handed to another registered
-- worker that has wake-ups still to take up to that one, for their first second ready
-- (composer_pick, sql/R__claim.sql), so a wake-up is not emptied by another worker's
-- claim taking its row; a poll takes any row.
--
-- Wake-ups are an optimisation; the poll is the safety net. A worker whose claim came
-- back short waits for a wake-up at most its poll interval, then claims again; a worker
-- whose slots were all taken registers the room a slot leaves when it frees, and waits
-- the same way. So a row whose wake-up is lost (its waiter was killed and its row
-- outlives it; its notification reached a worker that then had no room; it went to a
-- worker whose claim another took first, or to a busy worker whose handlers run long
-- while a slot frees elsewhere) waits at most one poll interval of any idle worker
-- serving it. A worker between its wake-up and its next claim stays registered, with
-- room for what it was not woken for. On Citus no claim registers: every dispatch
-- notifies the shared channel.
DROP FUNCTION IF EXISTS composer_enqueue(JSONB, TIMESTAMPTZ);
DROP FUNCTION IF EXISTS composer_enqueue(JSONB, TIMESTAMPTZ, INTERVAL);
CREATE OR REPLACE FUNCTION composer_enqueue(p_rows JSONB, p_now TIMESTAMPTZ, p_shift INTERVAL, p_gq TEXT[],
                                            p_gn TEXT[], p_gc INT[], p_ords INT[])
RETURNS VOID
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    gq TEXT[];              -- the rows to write, grouped by (queue, task name)
    gn TEXT[];
    gc INT[];               -- rows of each group no waiter has taken yet
    gords INT[];            -- the rows' places in p_rows, by group (gq, gn) then place
    go INT[];               -- where each group's rows no waiter has taken begin in gords, less one
    handed TEXT[];          -- by place in p_rows: the waiter the row is handed to (task_outbox.handed_to)
    qs TEXT[];              -- their distinct queues
    waiting INT;
    walk refcursor;
    v_w RECORD;
    v_k INT;
    v_t INT;
    v_all BOOLEAN;
    v_total BIGINT;
    v_partial BOOLEAN := false;
BEGIN
    -- The waiters are taken before the rows are written, so each row is written with the
    -- waiter it is handed to. The rows' groups (p_gq, p_gn, p_gc: queue, task name and
    -- count of each, by queue then task name; p_ords: the rows' places in p_rows, by
    -- group then place) are the client's (composer_ops/repo/outbox.py, groups); their
    -- order decides only which of a waiter's groups it is handed first. Checked here:
    -- every group named and counted, the counts adding up to the rows. Trusted: that the
    -- groups name the rows' own queues and task names, and the places each row once (a
    -- client that got them wrong would hand wake-ups amiss, which the poll covers; the
    -- rows are written from p_rows whatever the groups say).
    waiting := COALESCE(jsonb_array_length(p_rows), 0);
    IF waiting = 0 THEN
        RETURN;
    END IF;
    gq := p_gq;
    gn := p_gn;
    gc := p_gc;
    gords := p_ords;
    IF cardinality(gords) IS DISTINCT FROM waiting OR cardinality(gq) IS DISTINCT FROM cardinality(gn)
       OR cardinality(gq) IS DISTINCT FROM cardinality(gc) OR cardinality(gq) = 0 THEN
        RAISE EXCEPTION 'composer_enqueue: % rows, % places, groups of % queues, % names and % counts',
            waiting, cardinality(gords), cardinality(gq), cardinality(gn), cardinality(gc);
    END IF;
    go := array_fill(0, ARRAY[cardinality(gq)]);
    qs := ARRAY[gq[1]];
    FOR i IN 1 .. cardinality(gq) LOOP
        IF gq[i] IS NULL OR gn[i] IS NULL OR gc[i] IS NULL OR gc[i] < 1 THEN
            RAISE EXCEPTION 'composer_enqueue: group % is (%, %) counting %', i, gq[i], gn[i], gc[i];
        END IF;
        CONTINUE WHEN i = 1;
        go[i] := go[i - 1] + gc[i - 1];
        IF gq[i] <> gq[i - 1] THEN
            qs := qs || gq[i];
        END IF;
    END LOOP;
    IF go[cardinality(gq)] + gc[cardinality(gq)] IS DISTINCT FROM waiting THEN
        RAISE EXCEPTION 'composer_enqueue: % rows, groups counting %', waiting, go[cardinality(gq)] + gc[cardinality(gq)];
    END IF;
    handed := array_fill(NULL::text, ARRAY[waiting]);
    -- Pass 1, waiters with room, the most recently registered first, up to their room
    -- each; pass 2, busy waiters with at most one wake-up beyond their room so far, the
    -- least over-promised first, then the most recently registered, one row each.
    FOR v_pass IN 1 .. 2 LOOP
        EXIT WHEN waiting = 0;
        OPEN walk FOR
            SELECT x.worker, x.channel, x.queues, x.task_names,
                   CASE WHEN v_pass = 1 THEN x.slots - (x.promised - x.seen) ELSE 1 END AS room
              FROM task_waiters x
             WHERE x.queues && qs AND (x.task_names IS NULL OR x.task_names && gn)
               AND CASE WHEN v_pass = 1 THEN x.slots > x.promised - x.seen
                        ELSE x.promised - x.seen - x.slots BETWEEN 0 AND 1 END
             ORDER BY CASE WHEN v_pass = 1 THEN 0 ELSE x.promised - x.seen - x.slots END, x.since DESC
               FOR UPDATE SKIP LOCKED;
        WHILE waiting > 0 LOOP
            FETCH walk INTO v_w;
            EXIT WHEN NOT FOUND;
            v_k := 0;
            v_all := true;
            FOR i IN 1 .. cardinality(gq) LOOP
                IF gq[i] = ANY(v_w.queues) AND (v_w.task_names IS NULL OR gn[i] = ANY(v_w.task_names)) THEN
                    v_t := LEAST(gc[i], v_w.room - v_k);
                    FOR k IN go[i] + 1 .. go[i] + v_t LOOP
                        handed[gords[k]] := v_w.worker;
                    END LOOP;
                    go[i] := go[i] + v_t;
                    gc[i] := gc[i] - v_t;
                    v_k := v_k + v_t;
                ELSE
                    v_all := false;
                END IF;
            END LOOP;
            CONTINUE WHEN v_k = 0;
            waiting := waiting - v_k;
            v_partial := v_partial OR NOT v_all;
            UPDATE task_waiters x SET promised = x.promised + v_k WHERE x.worker = v_w.worker
            RETURNING x.promised INTO v_total;
            PERFORM pg_notify(v_w.channel, v_total::text);
        END LOOP;
        CLOSE walk;
    END LOOP;
    IF waiting = 1 AND NOT v_partial THEN
        -- One row left, every busy worker serving it held, at its two, or handed one by this
        -- dispatch: the least over-promised, then the most recently registered, is told,
        -- with no wake-up handed.
        FOR i IN 1 .. cardinality(gq) LOOP
            CONTINUE WHEN gc[i] = 0;
            SELECT x.worker, x.channel INTO v_w FROM task_waiters x
             WHERE gq[i] = ANY(x.queues) AND (x.task_names IS NULL OR gn[i] = ANY(x.task_names))
             ORDER BY x.promised - x.seen - x.slots, x.since DESC LIMIT 1;
            IF FOUND THEN
                PERFORM pg_notify(v_w.channel, '');
                handed[gords[go[i] + 1]] := v_w.worker;
                gc[i] := 0;
                waiting := 0;
            END IF;
        END LOOP;
    END IF;
    INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at, created_at,
                             priority, max_run_s, start_by, ckey, climit, rkey, rate_per_s, rate_burst, handed_to)
    SELECT d.q, d.r, d.t, d.a, d.n, d.l, COALESCE(d.av + p_shift, p_now), p_now, COALESCE(d.p, 0), d.m,
           COALESCE(d.av + p_shift, p_now) + make_interval(secs => d.w), d.ck, d.cl, d.rk, d.rp, d.rb,
           CASE WHEN d.av IS NULL OR d.av + p_shift <= p_now THEN handed[d.ord] END
      FROM ROWS FROM (jsonb_to_recordset(p_rows) AS (q text, r text, t text, a int4, n text, l int4, av timestamptz,
                                                     p int2, m int4, w float8, ck text, cl int4, rk text,
                                                     rp float8, rb int4))
           WITH ORDINALITY AS d(q, r, t, a, n, l, av, p, m, w, ck, cl, rk, rp, rb, ord);
    IF waiting > 0 OR v_partial THEN
        PERFORM pg_notify('composer_tasks', u.q)
           FROM (SELECT DISTINCT gq[i] AS q FROM generate_subscripts(gq, 1) AS i
                  WHERE v_partial OR gc[i] > 0 ORDER BY 1) u;
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION composer_enqueue(JSONB, TIMESTAMPTZ, INTERVAL, TEXT[], TEXT[], INT[], INT[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_enqueue(JSONB, TIMESTAMPTZ, INTERVAL, TEXT[], TEXT[], INT[], INT[])
    TO composer_ops_engine;
