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
--   1. a listening worker not yet registered in task_waiters inserts its row (queues,
--      task names, wake channel, the wake-ups it has taken up, its slots as if it got
--      all it asks for) before it takes any outbox row; an existing row (looked up
--      first: an INSERT ... ON CONFLICT meeting it would wait for a dispatch writing it)
--      is left unlocked, for dispatches meanwhile;
--   2. it deletes up to p_limit available outbox rows of its queues, highest priority
--      first, then oldest, FOR UPDATE SKIP LOCKED; a paused queue gives none, and a
--      queue with max_running gives at most its room (queue_settings, flow_slots:
--      sql/V003), counted under the queue's advisory lock;
--   3. it moves their tasks to RUNNING with a lease (never past the attempt's
--      start_to_close deadline, run_deadline_at, when its node has one), fenced on the attempt and on the
--      task still being PENDING or QUEUED, and writes each claimed task's run-history
--      row (marked with the claim's ID, which a retried claim looks up) in the same
--      statement. A task of a soft-deleted run is not claimed (its outbox row is
--      consumed all the same).
-- Step 3 runs per month, in a function of the month's own (composer_claim_tasks_source):
-- it names the month's task_instances and workflow_runs partitions, so its statements
-- are an ordinary table's, planned once per session and cached, and lock that month
-- only. Every statement of the claim runs on a generic plan (force_generic_plan: the
-- custom plan of the queue-settings read, say, would look cheaper at every call, and be
-- made at every call), which is safe as none reads a partitioned table (the history rows
-- are routed to their partition as they are inserted, which locks that partition only;
-- tests/integration/test_outbox_claim_months.py counts the locks). A generic plan
-- estimates an array parameter at 10 elements, and one made while a table is small
-- would scan it whole: with enable_seqscan off the claim's plans go through the indexes
-- (task update by run_id, outbox delete by id) whatever the tables held when planned.
-- A scan with no index to use (the wake-up count's read of task_waiters) is still a
-- sequential scan, costed at 10^10 by that setting (PostgreSQL 15 to 17; 18 counts
-- disabled nodes apart): far over jit_above_cost, so a server with JIT (PostgreSQL 15
-- as Debian builds it, on by default) compiled it at every call, 140 to 270 ms each;
-- the claim turns JIT off (tests/integration/test_outbox_claim_months.py).

-- Idle workers: a listening worker's claim registers it in task_waiters with its free
-- slots and the wake-ups it has taken up; a dispatch (composer_enqueue,
-- sql/R__dispatch.sql, which says how the two fit and why the poll is the safety net)
-- hands a waiter up to that many. task_waiters is UNLOGGED: after a crash it is empty
-- and every worker registers again at its next claim.

-- A dispatch with a concurrency key or a rate limit (task_outbox.ckey, rkey: sql/V003) is
-- taken only when composer_flow_admit says so; the pick (composer_pick) asks it about such
-- rows only, in its order, before it locks the row, and stops once it has the rows it
-- wants, so a key at its limit (or a bucket out of tokens) skips that key's rows, the walk
-- goes on to the rows behind them, and rows after the last one taken are never asked
-- about. Admitting consumes nothing; composer_flow_take, once the pick holds the row,
-- counts it against its key and takes its token. Per key:
--   concurrency: the key's advisory lock, tried (a claim taking the same key now holds it:
--     the row is skipped, as FOR UPDATE SKIP LOCKED skips a row), then held to the claim's
--     end; under it the key's running attempts (flow_slots 'c:<key>') plus what this claim
--     took already must stay below the row's limit. What this claim counted and took is
--     kept in a transaction-local setting, so each key is counted once per claim;
--   rate limit: the key's bucket row, locked SKIP LOCKED (locked by another claim: the
--     row is skipped) and held to the claim's end, refilled from the database clock
--     (per_s since updated_at, up to burst); admitted with a whole token in it.
-- A row taken whose task the claim then finds not claimable (cancelled meanwhile) has
-- counted or taken a token for nothing: conservative, never over a limit.
DROP FUNCTION IF EXISTS composer_flow_ok(TEXT, INT, TEXT, FLOAT8, INT);

CREATE OR REPLACE FUNCTION composer_flow_admit(p_ckey TEXT, p_climit INT, p_rkey TEXT, p_rate FLOAT8, p_burst INT)
RETURNS BOOLEAN
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    csetting TEXT := 'composer_flow.c' || md5(COALESCE(p_ckey, ''));
    held TEXT;
    occupied INT;
    v_tokens FLOAT8;
    since TIMESTAMPTZ;
BEGIN
    IF p_ckey IS NOT NULL THEN
        held := NULLIF(current_setting(csetting, true), '');
        IF held IS NULL THEN
            IF NOT pg_try_advisory_xact_lock(hashtext('composer_flow'), hashtext('c:' || p_ckey)) THEN
                RETURN false;
            END IF;
            SELECT count(*) INTO occupied FROM flow_slots f WHERE f.key = 'c:' || p_ckey;
            PERFORM set_config(csetting, occupied::text, true);
        ELSE
            occupied := held::int;
        END IF;
        IF occupied >= p_climit THEN
            RETURN false;
        END IF;
    END IF;
    IF p_rkey IS NOT NULL THEN
        IF current_setting('composer_flow.r' || md5(p_rkey), true) = 'empty' THEN
            RETURN false;
        END IF;
        INSERT INTO rate_buckets (key, tokens, updated_at) VALUES (p_rkey, p_burst, now())
        ON CONFLICT (key) DO NOTHING;
        SELECT b.tokens, b.updated_at INTO v_tokens, since FROM rate_buckets b WHERE b.key = p_rkey
           FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        v_tokens := LEAST(p_burst, v_tokens + p_rate * GREATEST(0, extract(epoch FROM now() - since)));
        IF v_tokens < 1 THEN
            UPDATE rate_buckets b SET tokens = v_tokens, updated_at = GREATEST(since, now())
             WHERE b.key = p_rkey;
            PERFORM set_config('composer_flow.r' || md5(p_rkey), 'empty', true);
            RETURN false;
        END IF;
    END IF;
    RETURN true;
END;
$$;

-- Count a row composer_flow_admit admitted and the pick now holds: one more place of its
-- key taken by this claim, one token out of its bucket (whose row lock admitting took).
CREATE OR REPLACE FUNCTION composer_flow_take(p_ckey TEXT, p_rkey TEXT, p_rate FLOAT8, p_burst INT)
RETURNS VOID
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    csetting TEXT := 'composer_flow.c' || md5(COALESCE(p_ckey, ''));
BEGIN
    IF p_ckey IS NOT NULL THEN
        PERFORM set_config(csetting, (current_setting(csetting)::int + 1)::text, true);
    END IF;
    IF p_rkey IS NOT NULL THEN
        UPDATE rate_buckets b
           SET tokens = LEAST(p_burst, b.tokens + p_rate * GREATEST(0, extract(epoch FROM now() - b.updated_at))) - 1,
               updated_at = GREATEST(b.updated_at, now())
         WHERE b.key = p_rkey;
    END IF;
END;
$$;

-- The claim's pick, on a single server (composer_claim) and on Citus (repo/citus.py):
-- up to p_limit ready outbox rows of p_queues (p_names NULL: of any task; p_skip: IDs
-- passed over), highest priority first, then oldest, each locked FOR UPDATE SKIP LOCKED
-- and returned in the order taken. It walks the ready rows in that order and stops once it
-- has p_limit, so flow control is asked only about rows the walk reaches, and a row's
-- place and token are taken only once the pick holds the row. (One statement with the
-- check in its WHERE evaluates it on every ready row of the queues before sorting them:
-- a token taken and a key's lock held for each, with one task claimed.) The walk reads
-- without locking (a cursor FOR UPDATE would lock every row it passed, the skipped ones
-- too, to the claim's end, and keep them from the claims that could take them); each row
-- it would take is admitted, then locked by its ID, SKIP LOCKED, in a statement of its own
-- whose snapshot sees what racing claims committed, and still ready.
-- Spread over runs: a row of a run in p_busy (the runs the claiming worker has tasks of
-- in flight) or of a run this pick already took a row of is put back (up to p_limit of
-- them, in order) and the walk goes on, for SPREAD more rows at most; the rows put back
-- are taken, in order, before any row of a lower priority, and when the walk ends or has
-- gone that far. So a worker's slots take the tasks of several runs where they are
-- ready, and their reports do not wait for each other's run lock (a 10-task fan-out's
-- siblings, docs/performance-log.md); with none else ready they take the same run's.
-- The walk is one cursor per queue, each in the order of idx_task_outbox_ready (queue,
-- priority DESC, available_at, id) with its queue fixed, merged here by that order: so a
-- claim reads the rows it takes and those it passes over, whatever the backlog. (One
-- cursor over queue = ANY(p_queues) cannot follow the index's order across queues, and
-- read and sorted every ready row of the queues at every claim: 7 ms of server CPU a
-- claim behind 20,000 ready rows, docs/performance.md.) A bitmap scan cannot follow the
-- index's order either, and a plan made while the table was nearly empty chose one or a
-- sequential scan, then sorted 20,000 rows: both off here, whatever the caller's settings
-- (and JIT, as composer_claim says why). Each queue listed costs a cursor, whether it has
-- ready rows or not.
-- Rows handed to another worker (p_me given: a woken worker's claim): a row whose
-- task_outbox.handed_to (sql/V018) names another worker still registered in task_waiters
-- with wake-ups it has not taken up (promised > seen: it will claim again) is passed over
-- for its first second ready, left to that worker's claim (its wake-up may be for it).
-- After that second (its worker was killed, or is busy with long handlers), or handed to
-- p_me, to nobody, to a worker no longer registered (stopped, or forgotten as dead) or
-- to one whose claims took up every wake-up handed to it (one took other rows), it is
-- taken as any other. p_me NULL (a poll, Citus): any row.
DROP FUNCTION IF EXISTS composer_pick(TEXT[], TEXT[], INT, BIGINT[]);
DROP FUNCTION IF EXISTS composer_pick(TEXT[], TEXT[], INT, BIGINT[], TEXT[]);
CREATE OR REPLACE FUNCTION composer_pick(p_queues TEXT[], p_names TEXT[], p_limit INT, p_skip BIGINT[] DEFAULT NULL,
                                         p_busy TEXT[] DEFAULT NULL, p_me TEXT DEFAULT NULL)
RETURNS SETOF BIGINT
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    spread CONSTANT INT := 64;  -- rows the walk may put back, at most
    handed_for CONSTANT INTERVAL := '1 second';  -- a row handed to another worker is left to it
    walks refcursor[] := '{}';
    heads task_outbox[] := '{}';
    opened TEXT[] := '{}';
    walk refcursor;
    q TEXT;
    r task_outbox;
    nxt task_outbox;
    best INT;
    taken INT := 0;
    later task_outbox[] := '{}';    -- rows put back, in order
    put_back INT := 0;
    runs TEXT[] := COALESCE(p_busy, '{}');
BEGIN
    IF p_queues IS NULL OR p_limit IS NULL OR p_limit <= 0 THEN
        RETURN;
    END IF;
    p_skip := array_remove(p_skip, NULL);      -- o.id <> ALL of an array with a NULL is never true
    FOREACH q IN ARRAY p_queues LOOP
        CONTINUE WHEN q IS NULL OR q = ANY(opened);
        opened := opened || q;
        walk := NULL;           -- a portal of its own (OPEN names it)
        OPEN walk FOR
            SELECT o.* FROM task_outbox o
             WHERE o.queue = q AND o.available_at <= now()
               AND (p_names IS NULL OR o.task_name = ANY(p_names))
               AND (p_skip IS NULL OR o.id <> ALL(p_skip))
             ORDER BY o.priority DESC, o.available_at, o.id;
        FETCH walk INTO r;
        IF FOUND THEN
            walks := walks || walk;
            heads := heads || r;
        ELSE
            CLOSE walk;
        END IF;
    END LOOP;
    LOOP
        best := NULL;           -- the queue whose head comes first
        FOR i IN 1 .. cardinality(heads) LOOP
            CONTINUE WHEN (heads[i]).id IS NULL;
            IF best IS NULL OR (heads[i]).priority > (heads[best]).priority
               OR ((heads[i]).priority = (heads[best]).priority
                   AND ((heads[i]).available_at, (heads[i]).id) < ((heads[best]).available_at, (heads[best]).id)) THEN
                best := i;
            END IF;
        END LOOP;
        IF cardinality(later) > 0
           AND (best IS NULL OR put_back >= spread OR (heads[best]).priority < (later[1]).priority) THEN
            r := later[1];      -- a row put back: its turn
            later := later[2:];
        ELSIF best IS NULL THEN
            EXIT;
        ELSE
            r := heads[best];
            walk := walks[best];
            FETCH walk INTO nxt;                -- none left: a row of NULLs
            heads[best] := nxt;
            IF p_me IS NOT NULL AND r.handed_to IS NOT NULL AND r.handed_to <> p_me
               AND r.available_at > now() - handed_for THEN
                CONTINUE WHEN EXISTS (SELECT 1 FROM task_waiters w
                                       WHERE w.worker = r.handed_to AND w.promised > w.seen);
            END IF;
            IF put_back < spread AND r.run_id = ANY(runs) THEN
                put_back := put_back + 1;
                IF cardinality(later) < p_limit THEN
                    later := later || r;
                END IF;
                CONTINUE;
            END IF;
        END IF;
        IF r.ckey IS NOT NULL OR r.rkey IS NOT NULL THEN
            CONTINUE WHEN NOT composer_flow_admit(r.ckey, r.climit, r.rkey, r.rate_per_s, r.rate_burst);
        END IF;
        -- By run ID too: on Citus that routes the lock to the row's shard.
        PERFORM 1 FROM task_outbox o WHERE o.run_id = r.run_id AND o.id = r.id AND o.available_at <= now()
            FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        IF r.ckey IS NOT NULL OR r.rkey IS NOT NULL THEN
            PERFORM composer_flow_take(r.ckey, r.rkey, r.rate_per_s, r.rate_burst);
        END IF;
        RETURN NEXT r.id;
        runs := runs || r.run_id;
        taken := taken + 1;
        EXIT WHEN taken >= p_limit;
    END LOOP;
    FOREACH walk IN ARRAY walks LOOP
        CLOSE walk;
    END LOOP;
END;
$$;

-- The UTC month (YYYYMM) of a canonical UUIDv7 run ID, the suffix of the partitions
-- holding the run (R__partitions.sql bounds them with composer_uuid7_bound); NULL for
-- any other text. The same as composer_ops/core/runids.py month_of.
CREATE OR REPLACE FUNCTION composer_run_month(p_run TEXT) RETURNS TEXT
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p_run ~ '^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$'
                THEN to_char(to_timestamp(('x' || substr(p_run, 1, 8) || substr(p_run, 10, 4))::bit(48)::bigint
                                          / 1000.0) AT TIME ZONE 'UTC', 'YYYYMM') END
$$;

-- The claim's step 3 (the header above) for the tasks of one month, as the text of a
-- CREATE FUNCTION: p_fn updates p_tasks and checks p_runs. One text, two uses:
--   composer_claim_tasks_pYYYYMM on the month's own partitions (composer_claim_month,
--   made with the partitions by composer_ensure_partitions_from): an ordinary table's
--   statements, so PL/pgSQL caches their plans, generic after five calls, and they lock
--   that month's partitions and indexes only;
--   composer_claim_tasks on the partitioned tables, for a run ID that is not a UUIDv7 or
--   a month without its function: a cached generic plan would lock every month before
--   pruning (PostgreSQL 15 to 18), so it is planned at every call with the run IDs'
--   values (force_custom_plan), and the planner keeps only their months.
-- The run IDs also stand as a constant array (t.run_id = ANY(...)) for that pruning.
CREATE OR REPLACE FUNCTION composer_claim_tasks_source(p_fn TEXT, p_tasks TEXT, p_runs TEXT, p_options TEXT)
RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $src$
    SELECT format($fn$
CREATE OR REPLACE FUNCTION %1$I(p_owner TEXT, p_claim TEXT, p_limited TEXT[], p_runs TEXT[], p_ids TEXT[],
                               p_attempts INT[], p_names TEXT[], p_leases INT[], p_queues TEXT[],
                               p_maxruns INT[], p_ckeys TEXT[])
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ)
LANGUAGE plpgsql
%4$s
AS $body$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        WITH claimed AS (
            UPDATE %2$I t
               SET state = 'RUNNING', lease_owner = p_owner,
                   lease_expires_at = NOW() + make_interval(secs => LEAST(p.lease_s, p.max_run_s)),
                   run_deadline_at = NOW() + make_interval(secs => p.max_run_s),
                   started_at = NOW(), updated_at = NOW(),
                   flow_slot = CASE WHEN p.queue = ANY(p_limited) OR p.ckey IS NOT NULL THEN true END
              FROM unnest(p_runs, p_ids, p_attempts, p_names, p_leases, p_queues, p_maxruns, p_ckeys)
                   AS p(run_id, task_id, attempt, task_name, lease_s, queue, max_run_s, ckey)
             WHERE t.run_id = ANY(p_runs)
               AND t.run_id = p.run_id AND t.id = p.task_id AND t.attempt = p.attempt
               AND t.state IN ('PENDING', 'QUEUED')
               AND NOT EXISTS (SELECT 1 FROM %3$I r
                                WHERE r.id = ANY(p_runs) AND r.id = t.run_id AND r.deleted_at IS NOT NULL)
            RETURNING t.run_id, t.id AS task_id, t.node_id, t.attempt, p.task_name, p.queue,
                      t.input_json AS input, LEAST(p.lease_s, p.max_run_s) AS lease_s, t.lease_owner,
                      t.lease_expires_at, p.ckey
        ), slotted AS (
            INSERT INTO flow_slots (key, run_id, task_id, attempt)
            SELECT 'queue:' || c.queue, c.run_id, c.task_id, c.attempt FROM claimed c WHERE c.queue = ANY(p_limited)
            UNION ALL
            SELECT 'c:' || c.ckey, c.run_id, c.task_id, c.attempt FROM claimed c WHERE c.ckey IS NOT NULL
            ON CONFLICT (key, run_id, task_id) DO UPDATE SET attempt = EXCLUDED.attempt, taken_at = now()
        ), noted AS (
            INSERT INTO run_history (run_id, kind, node_id, task_id, attempt, worker, request, detail)
            SELECT c.run_id, 'claimed', c.node_id, c.task_id, c.attempt, c.lease_owner, p_claim,
                   jsonb_build_object('task', c.task_name, 'lease_s', c.lease_s)
              FROM claimed c)
        SELECT c.run_id, c.task_id, c.node_id, c.attempt, c.task_name, c.queue, c.input, c.lease_s,
               c.lease_owner, c.lease_expires_at
          FROM claimed c;
END;
$body$;
REVOKE ALL ON FUNCTION %1$I(TEXT, TEXT, TEXT[], TEXT[], TEXT[], INT[], TEXT[], INT[], TEXT[], INT[], TEXT[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION %1$I(TEXT, TEXT, TEXT[], TEXT[], TEXT[], INT[], TEXT[], INT[], TEXT[], INT[], TEXT[])
    TO composer_ops_engine;
$fn$, p_fn, p_tasks, p_runs, p_options)
$src$;

DO $$
BEGIN
    EXECUTE composer_claim_tasks_source('composer_claim_tasks', 'task_instances', 'workflow_runs',
                                        'SET plan_cache_mode = force_custom_plan');
END;
$$;

-- Make (p_replace: or make again) the claim's function of month p_month (YYYYMM) when
-- both its workflow_runs and task_instances partitions are attached with exactly that
-- month's bounds (only then does a run ID's month name the partition holding it), and
-- drop it otherwise; true when it exists afterwards. Called with the partitions
-- (R__partitions.sql); the claim takes the partitioned tables for a month without one.
-- Not on Citus, whose claim is its own (repo/citus.py).
CREATE OR REPLACE FUNCTION composer_claim_month(p_month TEXT, p_replace BOOLEAN DEFAULT false)
RETURNS BOOLEAN
LANGUAGE plpgsql AS $$
DECLARE
    fn TEXT := 'composer_claim_tasks_p' || p_month;
BEGIN
    IF p_month IS NULL OR p_month !~ '^\d{6}$' OR EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
        RETURN false;
    END IF;
    IF NOT composer_month_aligned(p_month) THEN
        EXECUTE format('DROP FUNCTION IF EXISTS %I(TEXT, TEXT, TEXT[], TEXT[], TEXT[], INT[], TEXT[], INT[], TEXT[], '
                       'INT[], TEXT[])', fn);
        RETURN false;
    END IF;
    IF p_replace OR to_regproc(format('%I', fn)) IS NULL THEN
        EXECUTE composer_claim_tasks_source(fn, 'task_instances_p' || p_month, 'workflow_runs_p' || p_month, '');
    END IF;
    RETURN true;
END;
$$;
REVOKE ALL ON FUNCTION composer_claim_month(TEXT, BOOLEAN) FROM PUBLIC;

-- How many ready outbox rows of p_queues (p_names NULL: of any task) no wake-up on its
-- way covers, counting at most p_cap: wake-ups handed to other registered workers and
-- not yet taken up (promised - seen), and those handed to p_owner beyond p_seen, each
-- cover a row their worker will claim. Read without locks: a count too high costs an
-- empty claim somewhere, too low a wait for the next dispatch or the poll. The count
-- stops at its LIMIT on an index scan only: the bitmap scan its generic plan took when
-- made on an empty outbox reads every ready row's index entry first (2,013 read by a
-- claim behind 2,000 ready rows, tests/integration/test_claim_reads.py), so bitmap scans
-- are off here (and JIT with them, as composer_claim says why; docs/performance-log.md,
-- "The claim's count of ready rows").
CREATE OR REPLACE FUNCTION composer_uncovered(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_seen BIGINT,
                                              p_cap INT)
RETURNS INT
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    mine BIGINT;
    elsewhere BIGINT;
    ready BIGINT;
BEGIN
    IF p_cap IS NULL OR p_cap <= 0 THEN
        RETURN 0;
    END IF;
    SELECT GREATEST(w.promised - COALESCE(p_seen, w.promised), 0) INTO mine
      FROM task_waiters w WHERE w.worker = p_owner;
    SELECT COALESCE(sum(GREATEST(w.promised - w.seen, 0)), 0) INTO elsewhere
      FROM task_waiters w WHERE w.worker <> p_owner AND w.queues && p_queues;
    mine := COALESCE(mine, 0);
    SELECT count(*) INTO ready
      FROM (SELECT 1 FROM task_outbox o
             WHERE o.queue = ANY(p_queues) AND o.available_at <= now()
               AND (p_names IS NULL OR o.task_name = ANY(p_names))
             LIMIT p_cap + elsewhere + mine) AS r;
    RETURN LEAST(GREATEST(ready - elsewhere - mine, 0), p_cap);
END;
$$;
REVOKE ALL ON FUNCTION composer_uncovered(TEXT[], TEXT[], TEXT, BIGINT, INT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_uncovered(TEXT[], TEXT[], TEXT, BIGINT, INT) TO composer_ops_engine;

-- The claim workers make: p_limit tasks at most (the wake-ups the worker took up for
-- it), and, a listening worker with more free slots than that, as many more of the
-- ready rows no wake-up on its way covers (composer_uncovered) as those slots take: a
-- backlog no dispatch announces is claimed at full concurrency. p_room, its free slots, and p_seen, the total of wake-ups handed to it
-- (task_waiters.promised) it has taken up, make its registration: it can be handed
-- p_room - (what it claimed) more, less those on their way to it. Inserted at step 1
-- when missing, written at the end, where a row a dispatch holds (it has not committed)
-- is skipped rather than waited for, as waiting would hold this claim's outbox and task
-- rows while the dispatch may come to need them. A registration so left behind is what
-- the worker registered at its previous claim: as the dispatch took it, with room for
-- wake-ups the worker may have no slot for now, whose rows wait for one of its slots or
-- another worker's poll (sql/R__dispatch.sql), until its next claim writes it. p_seen
-- NULL: all handed out taken up. p_channel NULL: a caller that is not a listening
-- worker (no registration). p_busy: the runs the worker has tasks of in flight, whose
-- ready rows the pick takes after others (composer_pick, "spread over runs").
-- p_woken (with p_channel): the worker claims because it was woken (its own wake-ups,
-- told on its channel or the shared one): it takes none of the rows a dispatch handed
-- to another registered worker with wake-ups still to take up, in their first second
-- ready (composer_pick's p_me), so it does not take the row another worker was woken
-- for and leave that worker's claim empty. Otherwise (its poll, its first claim, its
-- claim when a slot frees after its slots were full) every ready row is its to take. A
-- row told to a worker with no wake-up handed (sql/R__dispatch.sql) is counted by
-- composer_uncovered as no wake-up's, and may be left to its worker all the same: a
-- claim owed a wake-up for it can come back empty.
CREATE OR REPLACE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
                               p_claim TEXT, p_channel TEXT, p_room INT, p_seen BIGINT, p_busy TEXT[],
                               p_woken BOOLEAN)
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    runs TEXT[];
    ids TEXT[];
    attempts INT[];
    names TEXT[];
    leases INT[];
    queues TEXT[];
    maxruns INT[];
    ckeys TEXT[];
    claimed INT := 0;
    open_queues TEXT[];
    limited TEXT[];
    limits INT[];
    pick_queues TEXT[];
    room INT;
    m_months TEXT[];
    m_month TEXT;
    got INT;
    m_runs TEXT[];
    m_ids TEXT[];
    m_attempts INT[];
    m_names TEXT[];
    m_leases INT[];
    m_queues TEXT[];
    m_maxruns INT[];
    m_ckeys TEXT[];
    lim INT := p_limit;
    owed INT := 0;
    mine BIGINT;
    total BIGINT;
    me TEXT;                -- composer_pick's p_me: a woken worker's claim
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
        -- Looked up first (step 1 above): an INSERT ... ON CONFLICT that meets the row
        -- while a dispatch or another claim of this worker writes it waits for that one.
        IF NOT EXISTS (SELECT 1 FROM task_waiters x WHERE x.worker = p_owner) THEN
            INSERT INTO task_waiters (worker, channel, queues, task_names, slots, promised, seen)
            VALUES (p_owner, p_channel, p_queues, p_names, GREATEST(p_room - p_limit, 0), COALESCE(p_seen, 0),
                    COALESCE(p_seen, 0))
            ON CONFLICT (worker) DO NOTHING;
        END IF;
        IF p_woken THEN
            me := p_owner;
        END IF;
        IF p_room > p_limit THEN
            -- The rows its p_limit wake-ups cover are among those counted.
            lim := GREATEST(p_limit, composer_uncovered(p_queues, p_names, p_owner, p_seen, p_room));
        END IF;
    END IF;
    -- The queue settings of p_queues (sql/V003; a queue without a row is open and
    -- unlimited): a paused queue is skipped, its tasks stay in the outbox; the open
    -- unlimited queues are taken together, then each limited one on its own, up to its
    -- room. One index probe of a small table when no queue has a row. Each queue once,
    -- however often p_queues names it (twice, it would be counted and picked twice,
    -- each time up to its whole room). Read without a lock: a pause or a limit that
    -- commits while this claim is under way does not hold it up, and this claim's tasks
    -- start (a limit's places, repo/queues.py hold_running, count the attempts running
    -- when it commits).
    SELECT array_agg(w.q) FILTER (WHERE s.queue IS NULL OR (NOT s.paused AND s.max_running = 0)),
           array_agg(w.q ORDER BY w.q) FILTER (WHERE NOT s.paused AND s.max_running > 0),
           array_agg(s.max_running ORDER BY w.q) FILTER (WHERE NOT s.paused AND s.max_running > 0)
      INTO open_queues, limited, limits
      FROM (SELECT DISTINCT x.q FROM unnest(p_queues) AS x(q) WHERE x.q IS NOT NULL) AS w(q)
           LEFT JOIN queue_settings s ON s.queue = w.q;
    FOR i IN 0 .. COALESCE(array_length(limited, 1), 0) LOOP
        IF i = 0 THEN
            pick_queues := open_queues;
            room := lim;
        ELSE
            EXIT WHEN COALESCE(array_length(runs, 1), 0) >= lim;
            pick_queues := ARRAY[limited[i]];
            -- Held to this claim's end: a racing claim of the queue counts after this
            -- one's slots are committed (each statement here takes a new snapshot).
            PERFORM pg_advisory_xact_lock(hashtext('composer_flow'), hashtext('queue:' || limited[i]));
            SELECT limits[i] - count(*) INTO room FROM flow_slots f WHERE f.key = 'queue:' || limited[i];
            room := LEAST(room, lim - COALESCE(array_length(runs, 1), 0));
        END IF;
        CONTINUE WHEN pick_queues IS NULL OR room <= 0;
        -- The pick runs once (MATERIALIZED): as a subquery the planner could rescan it on
        -- the inner side of a nested loop, and pick again.
        WITH s AS MATERIALIZED (
            SELECT p.id FROM composer_pick(pick_queues, p_names, room, NULL, p_busy, me) AS p(id)
        ), picked AS (
            DELETE FROM task_outbox o
             WHERE o.id = ANY (ARRAY(SELECT s.id FROM s))
            RETURNING o.run_id, o.task_id, o.attempt, o.task_name, o.lease_s, o.queue, o.max_run_s, o.ckey)
        SELECT runs || array_agg(picked.run_id), ids || array_agg(picked.task_id),
               attempts || array_agg(picked.attempt), names || array_agg(picked.task_name),
               leases || array_agg(picked.lease_s), queues || array_agg(picked.queue),
               maxruns || array_agg(picked.max_run_s), ckeys || array_agg(picked.ckey),
               m_months || array_agg(DISTINCT composer_run_month(picked.run_id))
          INTO runs, ids, attempts, names, leases, queues, maxruns, ckeys, m_months
          FROM picked;
    END LOOP;
    -- Step 3, one month at a time (composer_claim_tasks_source says why); the one month
    -- of almost every claim takes the arrays as they are.
    IF runs IS NOT NULL THEN
        IF cardinality(m_months) > 1 THEN     -- months of several passes of the loop
            SELECT array_agg(DISTINCT u.m) INTO m_months FROM unnest(m_months) AS u(m);
        END IF;
        FOREACH m_month IN ARRAY m_months LOOP
            IF cardinality(m_months) = 1 THEN
                m_runs := runs; m_ids := ids; m_attempts := attempts; m_names := names; m_leases := leases;
                m_queues := queues; m_maxruns := maxruns; m_ckeys := ckeys;
            ELSE
                SELECT array_agg(u.r ORDER BY u.n), array_agg(u.i ORDER BY u.n), array_agg(u.a ORDER BY u.n),
                       array_agg(u.t ORDER BY u.n), array_agg(u.l ORDER BY u.n), array_agg(u.q ORDER BY u.n),
                       array_agg(u.m ORDER BY u.n), array_agg(u.k ORDER BY u.n)
                  INTO m_runs, m_ids, m_attempts, m_names, m_leases, m_queues, m_maxruns, m_ckeys
                  FROM unnest(runs, ids, attempts, names, leases, queues, maxruns, ckeys)
                       WITH ORDINALITY AS u(r, i, a, t, l, q, m, k, n)
                 WHERE composer_run_month(u.r) IS NOT DISTINCT FROM m_month;
            END IF;
            -- The month's own function while both its partitions are there under their
            -- names (a month dropped or detached has neither: retention and detach take
            -- only months without active runs, and a run whose task has an outbox row is
            -- active, so no claim is waiting for one); the partitioned tables otherwise.
            IF m_month IS NOT NULL AND to_regproc('composer_claim_tasks_p' || m_month) IS NOT NULL
               AND to_regclass('task_instances_p' || m_month) IS NOT NULL
               AND to_regclass('workflow_runs_p' || m_month) IS NOT NULL THEN
                RETURN QUERY EXECUTE format('SELECT * FROM %I($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)',
                                            'composer_claim_tasks_p' || m_month)
                    USING p_owner, p_claim, limited, m_runs, m_ids, m_attempts, m_names, m_leases, m_queues,
                          m_maxruns, m_ckeys;
            ELSE
                RETURN QUERY SELECT * FROM composer_claim_tasks(p_owner, p_claim, limited, m_runs, m_ids, m_attempts,
                                                                m_names, m_leases, m_queues, m_maxruns, m_ckeys);
            END IF;
            GET DIAGNOSTICS got = ROW_COUNT;
            claimed := claimed + got;
        END LOOP;
    END IF;
    -- The registration, with the room this claim leaves. A row locked here is held by a
    -- dispatch that has not committed (busy workers' rows too, sql/R__dispatch.sql):
    -- skipped (header above), the worker's next claim writes it. A claim that took all it
    -- could may have left ready rows behind that no wake-up on its way covers: it hands
    -- its worker wake-ups for them, as many as the room it still has (a race: rows
    -- committed meanwhile), or, with no room left and none on its way, one (claimed when
    -- a slot frees); with its registration skipped, it tells its worker on its own
    -- channel with an empty payload for one (it claims all it has room for), or every
    -- worker for more. Otherwise the worker waits for a wake-up instead of claiming on
    -- spec.
    IF p_channel IS NOT NULL THEN
        IF claimed >= lim THEN
            SELECT GREATEST(w.promised - COALESCE(p_seen, w.promised), 0) INTO mine
              FROM task_waiters w WHERE w.worker = p_owner;
            mine := COALESCE(mine, 0);
            owed := composer_uncovered(p_queues, p_names, p_owner, p_seen,
                                       GREATEST(p_room - claimed - mine, CASE WHEN mine = 0 THEN 1 ELSE 0 END)::int);
        END IF;
        UPDATE task_waiters w
           SET channel = p_channel, queues = p_queues, task_names = p_names, slots = p_room - claimed,
               promised = GREATEST(w.promised, COALESCE(p_seen, w.promised)) + owed,
               seen = GREATEST(w.seen, COALESCE(p_seen, w.promised)), since = now()
         WHERE w.worker = (SELECT x.worker FROM task_waiters x WHERE x.worker = p_owner FOR UPDATE SKIP LOCKED)
        RETURNING w.promised INTO total;
        IF owed > 0 AND total IS NOT NULL THEN
            PERFORM pg_notify(p_channel, total::text);
        ELSIF owed = 1 THEN                 -- the registration skipped: told, no wake-up handed
            PERFORM pg_notify(p_channel, '');
        ELSIF owed > 1 THEN                 -- the same, for more: every worker is told
            PERFORM pg_notify('composer_tasks', u.q) FROM unnest(p_queues) AS u(q);
        END IF;
    END IF;
END;
$$;

-- The nine-, eight-, seven- and six-argument claims, of callers that claim as a poll
-- does (p_woken false), name no runs in flight (p_busy NULL), count no wake-ups (p_seen
-- NULL) or no free slots either (p_room = p_limit): the claim above.
CREATE OR REPLACE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
                               p_claim TEXT, p_channel TEXT, p_room INT, p_seen BIGINT, p_busy TEXT[])
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ)
LANGUAGE sql
AS $$
    SELECT * FROM composer_claim(p_queues, p_names, p_owner, p_limit, p_claim, p_channel, p_room, p_seen, p_busy,
                                 false)
$$;

CREATE OR REPLACE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
                               p_claim TEXT, p_channel TEXT, p_room INT, p_seen BIGINT)
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ)
LANGUAGE sql
AS $$
    SELECT * FROM composer_claim(p_queues, p_names, p_owner, p_limit, p_claim, p_channel, p_room, p_seen, NULL::text[])
$$;

CREATE OR REPLACE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
                               p_claim TEXT, p_channel TEXT, p_room INT)
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ)
LANGUAGE sql
AS $$
    SELECT * FROM composer_claim(p_queues, p_names, p_owner, p_limit, p_claim, p_channel, p_room, NULL::bigint)
$$;

CREATE OR REPLACE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
                               p_claim TEXT, p_channel TEXT)
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ)
LANGUAGE sql
AS $$
    SELECT * FROM composer_claim(p_queues, p_names, p_owner, p_limit, p_claim, p_channel, p_limit, NULL::bigint)
$$;

REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT) TO composer_ops_engine;
REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT) TO composer_ops_engine;
REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT, BIGINT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT, BIGINT) TO composer_ops_engine;
REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT, BIGINT, TEXT[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT, BIGINT, TEXT[])
    TO composer_ops_engine;
REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT, BIGINT, TEXT[], BOOLEAN) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT, TEXT, INT, BIGINT, TEXT[], BOOLEAN)
    TO composer_ops_engine;

-- A running attempt that took a slot (task_instances.flow_slot, set by the claim) frees
-- it when it leaves RUNNING, whatever moves it (completion, failure, re-queue after a
-- lost lease, cancel), in that transaction. Only tasks with flow_slot fire it. Not on
-- Citus: there the tasks live on the worker nodes and flow_slots on the coordinator,
-- and the Citus claim frees slots lazily instead (composer_ops/repo/citus_flow.py).
-- The place freed may be what ready rows wait for (rows of its key, or of its queue when
-- the queue has a limit), and no dispatch is coming for them: with such a row, a worker
-- serving its queue and its task is told, as a dispatch tells one (sql/R__dispatch.sql:
-- the least over-promised, then the most recently registered, on its own channel with
-- an empty payload, sent when this transaction commits, so its claim sees the place
-- free), or, none registered, the shared channel. Otherwise the rows waited for the
-- next poll of a worker: a second a task in one place. Places freed together (a cancel)
-- tell one worker, which claims all it has room for. Scans as the claim's (header).
CREATE OR REPLACE FUNCTION composer_free_flow_slot() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    q TEXT := COALESCE(OLD.queue, 'default');
    freed TEXT[];
    ready TEXT;
    told TEXT;
BEGIN
    WITH d AS (DELETE FROM flow_slots f WHERE f.run_id = OLD.run_id AND f.task_id = OLD.id RETURNING f.key)
    SELECT array_agg(d.key) INTO freed FROM d;
    IF freed IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT o.task_name INTO ready FROM task_outbox o
     WHERE o.queue = q AND o.available_at <= now()
       AND ('queue:' || q = ANY(freed) OR 'c:' || o.ckey = ANY(freed))
     ORDER BY o.priority DESC, o.available_at, o.id LIMIT 1;
    IF FOUND THEN
        SELECT x.channel INTO told FROM task_waiters x
         WHERE q = ANY(x.queues) AND (x.task_names IS NULL OR ready = ANY(x.task_names))
         ORDER BY x.promised - x.seen - x.slots, x.since DESC LIMIT 1;
        PERFORM pg_notify(COALESCE(told, 'composer_tasks'), CASE WHEN told IS NULL THEN q ELSE '' END);
    END IF;
    RETURN NULL;
END;
$$;

-- Created once sql/V003 has added the column (the R files also run after each earlier V
-- file alone, tests/integration/test_migrate.py).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')
       AND EXISTS (SELECT 1 FROM pg_attribute
                    WHERE attrelid = 'task_instances'::regclass AND attname = 'flow_slot' AND NOT attisdropped) THEN
        CREATE OR REPLACE TRIGGER composer_free_flow_slot
            AFTER UPDATE OF state ON task_instances
            FOR EACH ROW
            WHEN (OLD.flow_slot AND OLD.state = 'RUNNING' AND NEW.state IS DISTINCT FROM 'RUNNING')
            EXECUTE FUNCTION composer_free_flow_slot();
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION composer_pick(TEXT[], TEXT[], INT, BIGINT[], TEXT[], TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_pick(TEXT[], TEXT[], INT, BIGINT[], TEXT[], TEXT) TO composer_ops_engine;
REVOKE ALL ON FUNCTION composer_flow_admit(TEXT, INT, TEXT, FLOAT8, INT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_flow_admit(TEXT, INT, TEXT, FLOAT8, INT) TO composer_ops_engine;
REVOKE ALL ON FUNCTION composer_flow_take(TEXT, TEXT, FLOAT8, INT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_flow_take(TEXT, TEXT, FLOAT8, INT) TO composer_ops_engine;
