-- Retention: the plan (which months may go, and why) and the drop that follows it. A
-- repeatable file (docs/architecture.md, "where new code goes").
--
-- composer_retention_plan is the single source of truth: `composer-ops partitions
-- drop` (dry run) shows it, and composer_drop_partitions drops exactly the months it
-- marks 'drop', so the two cannot disagree.

-- One row per partition month (YYYYMM suffix), oldest first:
--   action 'drop' | 'keep'; reason 'too new' | 'has active runs' | 'has live children' |
--   'bounds do not match its name: <partition> holds [<from>, <to>) UTC; ...' (its month's
--   partitions whose bounds are not the month's, composer_misaligned_bounds: refused) |
--   'past cut-off, no active runs';
--   active_runs / active_run_ids: RUNNING or PENDING runs of the month (first 20 ids), or for
--   'has live children' the finished runs of the month whose SUB_WORKFLOW child runs (in
--   their own, later months) are still RUNNING or PENDING, found through the parent index;
--   rows: estimates (exact counts when exact_rows), bytes: heap + indexes + toast, both
--   summed over the month's partitions of the run tables (composer_partition_stats()).
-- A month is 'too new' while it is the current or a future month, or ended less than
-- min_age ago (the engine passes its run-ID age limit, one hour: a client-supplied run
-- ID may be that old, so the previous month still receives runs for the first hour of
-- a new one), whatever the cut-off. Reads catalogs, plus one query per month old
-- enough to drop on that month's workflow_runs partition (its status is not indexed;
-- old months are small and cold).
CREATE OR REPLACE FUNCTION composer_retention_plan(older_than TIMESTAMPTZ, exact_rows BOOLEAN, min_age INTERVAL)
RETURNS TABLE(month TEXT, month_start TIMESTAMPTZ, month_end TIMESTAMPTZ, action TEXT, reason TEXT,
              active_runs BIGINT, active_run_ids TEXT[], partitions TEXT[], rows BIGINT, bytes BIGINT)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    m RECORD;
    part TEXT;
    n BIGINT;
    runs_part TEXT;
    misaligned TEXT;
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
               COALESCE(sum(st.total_bytes), 0)::bigint AS total_bytes,
               COALESCE(sum(st.rows), 0)::bigint AS est_rows
          FROM (SELECT c.relname::text AS relname,
                       array_position(composer_run_tables(), p.relname::text) AS table_order,
                       substring(c.relname FROM '_p(\d{6})$') AS suffix
                  FROM pg_inherits i
                  JOIN pg_class c ON c.oid = i.inhrelid
                  JOIN pg_class p ON p.oid = i.inhparent
                 WHERE p.oid = ANY(composer_run_tables()::regclass[])) s
          LEFT JOIN (SELECT ps.partition, sum(ps.rows) AS rows, sum(ps.total_bytes) AS total_bytes
                       FROM composer_partition_stats() ps GROUP BY ps.partition) st ON st.partition = s.relname
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
            -- A partition whose bounds are not its name's month holds other rows than the
            -- month's: judged by its name it could be dropped with newer runs in it.
            SELECT string_agg(format('%s holds %s', x.part, composer_misaligned_bounds(to_regclass(format('%I', x.part)))),
                              '; ' ORDER BY x.ord)
              INTO misaligned
              FROM unnest(m.parts) WITH ORDINALITY AS x(part, ord)
             WHERE composer_misaligned_bounds(to_regclass(format('%I', x.part))) IS NOT NULL;
            IF misaligned IS NOT NULL THEN
                action := 'keep';
                reason := 'bounds do not match its name: ' || misaligned;
                RETURN NEXT;
                CONTINUE;
            END IF;
            runs_part := 'workflow_runs_p' || m.suffix;
            IF runs_part = ANY(m.parts) THEN
                EXECUTE format('SELECT count(*), COALESCE((array_agg(id ORDER BY id))[1:20], ARRAY[]::TEXT[])
                                  FROM %I WHERE status IN (''RUNNING'', ''PENDING'')', runs_part)
                   INTO active_runs, active_run_ids;
            END IF;
            IF active_runs = 0 THEN
                SELECT count(DISTINCT c.parent_run_id),
                       COALESCE((array_agg(DISTINCT c.parent_run_id ORDER BY c.parent_run_id))[1:20], ARRAY[]::TEXT[])
                  INTO active_runs, active_run_ids
                  FROM workflow_runs c
                 WHERE c.parent_run_id >= composer_uuid7_bound(month_start) COLLATE "C"
                   AND c.parent_run_id < composer_uuid7_bound(month_end) COLLATE "C"
                   AND c.status IN ('RUNNING', 'PENDING');
                IF active_runs > 0 THEN
                    action := 'keep';
                    reason := 'has live children';
                    RETURN NEXT;
                    CONTINUE;
                END IF;
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

-- The two-argument form, with the run-ID age limit of one hour.
CREATE OR REPLACE FUNCTION composer_retention_plan(older_than TIMESTAMPTZ, exact_rows BOOLEAN DEFAULT false)
RETURNS TABLE(month TEXT, month_start TIMESTAMPTZ, month_end TIMESTAMPTZ, action TEXT, reason TEXT,
              active_runs BIGINT, active_run_ids TEXT[], partitions TEXT[], rows BIGINT, bytes BIGINT)
LANGUAGE sql STABLE AS $$
    SELECT * FROM composer_retention_plan(older_than, exact_rows, INTERVAL '1 hour')
$$;

-- Lock every month the plan would drop (ACCESS EXCLUSIVE on the run tables themselves,
-- then on the month's partitions, each in composer_run_tables() order, as the engine
-- writes them), judge again under those locks, and drop only what is still due. Parents
-- first, as repo/retention.py lock_months and PostgreSQL's own DROP and DETACH take
-- them: a drop holding a month while it waits for a parent would deadlock with a reader
-- holding the parent on its way to the month. A start that committed into such a month
-- while the lock was awaited is seen; one that comes later waits for the lock and then
-- finds no partition (refused, never lost; tests/integration/test_retention_races.py).
-- The tables other than workflow_runs are dropped first, then workflow_runs' month is
-- detached and dropped, so foreign keys never see orphans. Returns the dropped months
-- (YYYYMM). The caller sets lock_timeout: each LOCK, DROP and DETACH then waits at most
-- that long, and the caller retries later.
CREATE OR REPLACE FUNCTION composer_drop_partitions(older_than TIMESTAMPTZ, min_age INTERVAL)
RETURNS SETOF TEXT
LANGUAGE plpgsql AS $$
DECLARE
    p RECORD;
    part TEXT;
    tbl TEXT;
    locked TEXT[] := ARRAY[]::TEXT[];
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('composer_partitions'));
    FOR p IN SELECT plan.month, plan.partitions FROM composer_retention_plan(older_than, false, min_age) plan
              WHERE plan.action = 'drop' ORDER BY plan.month
    LOOP
        IF locked = ARRAY[]::TEXT[] THEN             -- the parents once, before any month
            FOREACH tbl IN ARRAY composer_run_tables() LOOP
                EXECUTE format('LOCK TABLE ONLY %I IN ACCESS EXCLUSIVE MODE', tbl);
            END LOOP;
        END IF;
        FOREACH part IN ARRAY p.partitions LOOP      -- in composer_run_tables() order
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', part);
        END LOOP;
        locked := locked || p.month;
    END LOOP;
    -- A new statement, so a new snapshot: it sees every run committed before the locks.
    FOR p IN SELECT plan.month FROM composer_retention_plan(older_than, false, min_age) plan
              WHERE plan.action = 'drop' AND plan.month = ANY(locked) ORDER BY plan.month
    LOOP
        FOREACH tbl IN ARRAY composer_run_tables() LOOP
            CONTINUE WHEN tbl = 'workflow_runs';
            EXECUTE format('DROP TABLE IF EXISTS %I', tbl || '_p' || p.month);
        END LOOP;
        IF to_regclass(format('%I', 'workflow_runs_p' || p.month)) IS NOT NULL THEN
            EXECUTE format('ALTER TABLE workflow_runs DETACH PARTITION %I', 'workflow_runs_p' || p.month);
            EXECUTE format('DROP TABLE %I', 'workflow_runs_p' || p.month);
        END IF;
        PERFORM composer_claim_month(p.month), composer_load_month(p.month);   -- dropped with the month
        RETURN NEXT p.month;
    END LOOP;
END;
$$;

-- The seed's entry point, same signature and promise (drop whole UTC months that
-- ended at or before older_than and have no active run; return their YYYYMM), with the
-- run-ID age limit of one hour.
CREATE OR REPLACE FUNCTION composer_drop_partitions(older_than TIMESTAMPTZ) RETURNS SETOF TEXT
LANGUAGE sql AS $$
    SELECT composer_drop_partitions(older_than, INTERVAL '1 hour')
$$;

-- Only the owner drops partitions.
REVOKE EXECUTE ON FUNCTION composer_drop_partitions(TIMESTAMPTZ) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION composer_drop_partitions(TIMESTAMPTZ, INTERVAL) FROM PUBLIC;

-- On Citus the drops run in sequential mode (R__partitions.sql says why).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
        ALTER FUNCTION composer_drop_partitions(TIMESTAMPTZ, INTERVAL)
            SET citus.multi_shard_modify_mode = 'sequential';
        ALTER FUNCTION composer_drop_partitions(TIMESTAMPTZ) SET citus.multi_shard_modify_mode = 'sequential';
    END IF;
END;
$$;
