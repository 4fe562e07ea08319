-- V010: retention judges a month only while holding its partitions, and keeps the
-- months that can still receive runs; dropped months are recorded.
--
-- composer_drop_partitions (V004) read the plan, which looks for active runs in each
-- month, and only then asked for the locks its DROP and DETACH need. A start that was
-- inserting into such a month (a client-supplied run ID may be up to an hour old, so
-- the previous month still receives runs for the first hour of a new one) held the
-- partition's lock; the DETACH waited for it, the start committed, and the month was
-- dropped with the new run (tests/integration/test_retention_races.py shows it).
-- Now every month the plan would drop is locked first (ACCESS EXCLUSIVE on its three
-- partitions, in foreign-key order, as the engine writes them), then the plan is read
-- again under those locks, and only what it still marks 'drop' is dropped: a start
-- that committed while the lock was awaited is seen, one that comes later waits for
-- the lock and then finds no partition (refused, never lost).
--
-- The plan gains min_age: a month is 'too new' until it ended at least min_age ago
-- (the engine passes its run-ID age limit, one hour), so no run can still be started
-- into a month retention judges. The two- and one-argument forms keep the seed's and
-- V004's signatures and promise with min_age = 1 hour.
--
-- retention_drops records each dropped month with the request that dropped it, in
-- the drop's transaction: a drop retried after its COMMIT acknowledgement was lost
-- finds its own record and reports what it dropped (composer_ops/repo/retention.py).

CREATE OR REPLACE FUNCTION composer_retention_plan(older_than TIMESTAMPTZ, exact_rows BOOLEAN, min_age INTERVAL)
RETURNS TABLE(month TEXT, month_start TIMESTAMPTZ, month_end TIMESTAMPTZ, action TEXT, reason TEXT,
              active_runs BIGINT, active_run_ids TEXT[], partitions TEXT[], rows BIGINT, bytes BIGINT)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    m RECORD;
    part TEXT;
    n BIGINT;
    runs_part TEXT;
    horizon TIMESTAMPTZ;
BEGIN
    IF older_than IS NULL OR min_age IS NULL THEN
        RAISE EXCEPTION 'older_than and min_age must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- Never the current or a future month, nor one that ended less than min_age ago,
    -- even for a cut-off in the future.
    horizon := LEAST(older_than, composer_month_start((now() AT TIME ZONE 'UTC')::date), now() - min_age);
    FOR m IN
        SELECT s.suffix,
               array_agg(s.relname ORDER BY s.table_order) AS parts,
               sum(pg_total_relation_size(s.oid))::bigint AS total_bytes,
               sum(CASE WHEN s.reltuples >= 0 THEN s.reltuples
                        ELSE pg_stat_get_live_tuples(s.oid) END)::bigint AS est_rows
          FROM (SELECT c.oid, c.relname::text AS relname, c.reltuples,
                       array_position(ARRAY['workflow_runs', 'task_instances', 'workflow_events'],
                                      p.relname::text) AS table_order,
                       substring(c.relname FROM '_p(\d{6})$') AS suffix
                  FROM pg_inherits i
                  JOIN pg_class c ON c.oid = i.inhrelid
                  JOIN pg_class p ON p.oid = i.inhparent
                 WHERE p.oid IN ('workflow_runs'::regclass, 'task_instances'::regclass,
                                 'workflow_events'::regclass)) s
         WHERE composer_suffix_month(s.suffix) IS NOT NULL
         GROUP BY s.suffix
         ORDER BY s.suffix
    LOOP
        month := m.suffix;
        month_start := composer_suffix_month(m.suffix)::timestamp AT TIME ZONE 'UTC';
        month_end := (composer_suffix_month(m.suffix) + INTERVAL '1 month') AT TIME ZONE 'UTC';
        partitions := m.parts;
        bytes := m.total_bytes;
        rows := m.est_rows;
        IF exact_rows THEN
            rows := 0;
            FOREACH part IN ARRAY m.parts LOOP
                EXECUTE format('SELECT count(*) FROM %I', part) INTO n;
                rows := rows + n;
            END LOOP;
        END IF;
        active_runs := 0;
        active_run_ids := ARRAY[]::TEXT[];
        IF month_end > horizon THEN
            action := 'keep';
            reason := 'too new';
        ELSE
            runs_part := 'workflow_runs_p' || m.suffix;
            IF runs_part = ANY(m.parts) THEN
                EXECUTE format('SELECT count(*), COALESCE((array_agg(id ORDER BY id))[1:20], ARRAY[]::TEXT[])
                                  FROM %I WHERE status IN (''RUNNING'', ''PENDING'')', runs_part)
                   INTO active_runs, active_run_ids;
            END IF;
            IF active_runs > 0 THEN
                action := 'keep';
                reason := 'has active runs';
            ELSE
                action := 'drop';
                reason := 'past cut-off, no active runs';
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;

-- V004's signature, same promise, with the run-ID age limit of one hour.
CREATE OR REPLACE FUNCTION composer_retention_plan(older_than TIMESTAMPTZ, exact_rows BOOLEAN DEFAULT false)
RETURNS TABLE(month TEXT, month_start TIMESTAMPTZ, month_end TIMESTAMPTZ, action TEXT, reason TEXT,
              active_runs BIGINT, active_run_ids TEXT[], partitions TEXT[], rows BIGINT, bytes BIGINT)
LANGUAGE sql STABLE AS $$
    SELECT * FROM composer_retention_plan(older_than, exact_rows, INTERVAL '1 hour')
$$;

-- Lock every month the plan would drop, judge again under the locks, drop what is
-- still due; returns the dropped months (YYYYMM). The caller sets lock_timeout: each
-- LOCK, DROP and DETACH then waits at most that long, and the caller retries later.
CREATE OR REPLACE FUNCTION composer_drop_partitions(older_than TIMESTAMPTZ, min_age INTERVAL)
RETURNS SETOF TEXT
LANGUAGE plpgsql AS $$
DECLARE
    p RECORD;
    part TEXT;
    locked TEXT[] := ARRAY[]::TEXT[];
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('composer_partitions'));
    FOR p IN SELECT plan.month, plan.partitions FROM composer_retention_plan(older_than, false, min_age) plan
              WHERE plan.action = 'drop' ORDER BY plan.month
    LOOP
        FOREACH part IN ARRAY p.partitions LOOP      -- workflow_runs, task_instances, workflow_events
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', part);
        END LOOP;
        locked := locked || p.month;
    END LOOP;
    -- A new statement, so a new snapshot: it sees every run committed before the locks.
    FOR p IN SELECT plan.month FROM composer_retention_plan(older_than, false, min_age) plan
              WHERE plan.action = 'drop' AND plan.month = ANY(locked) ORDER BY plan.month
    LOOP
        -- Referencing tables first, so their foreign keys never see orphans.
        EXECUTE format('DROP TABLE IF EXISTS %I', 'workflow_events_p' || p.month);
        EXECUTE format('DROP TABLE IF EXISTS %I', 'task_instances_p' || p.month);
        IF to_regclass(format('%I', 'workflow_runs_p' || p.month)) IS NOT NULL THEN
            EXECUTE format('ALTER TABLE workflow_runs DETACH PARTITION %I', 'workflow_runs_p' || p.month);
            EXECUTE format('DROP TABLE %I', 'workflow_runs_p' || p.month);
        END IF;
        RETURN NEXT p.month;
    END LOOP;
END;
$$;

-- The seed's signature and promise, with the run-ID age limit of one hour.
CREATE OR REPLACE FUNCTION composer_drop_partitions(older_than TIMESTAMPTZ) RETURNS SETOF TEXT
LANGUAGE sql AS $$
    SELECT composer_drop_partitions(older_than, INTERVAL '1 hour')
$$;

-- Only the owner drops partitions (V004, V006).
REVOKE EXECUTE ON FUNCTION composer_drop_partitions(TIMESTAMPTZ) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION composer_drop_partitions(TIMESTAMPTZ, INTERVAL) FROM PUBLIC;

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
