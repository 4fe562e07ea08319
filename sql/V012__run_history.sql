-- V012: the history of every run, and lease expiries counted apart from handler failures.
--
-- run_history holds what a run's own rows do not show: every claim of a task (with the
-- worker), a lease a worker found lost, a lease that expired, a failure and whether it
-- was re-queued, a completion, a signal (resolving a node, buffered, consumed later by
-- a node, refused), a timer, a cancel, a task a worker abandoned at shutdown, and
-- operator actions. Each row is written in the same transaction as the change it
-- describes, mostly by the same statement. It is partitioned like the run tables, by
-- run ID, so a run's history lives in its run's month and retention drops it with the
-- month. `seq` orders the rows of a run (several rows can share one transaction's `at`).
--
-- `request` makes every write that may be retried idempotent. Each call of the engine's
-- API mints a request ID once and keeps it across the retries of its transaction; the
-- rows the call writes carry it. A retry (only a retry) first looks for rows of its
-- request under the run's lock: if the attempt whose COMMIT acknowledgement was lost
-- did commit, they are there (they committed with it), and the retry returns the
-- original outcome instead of applying the change again. A signal sent with the
-- caller's idempotency key uses 'key:' || key as its request, so two calls with one
-- key resolve at most one node. The claim, which takes no run lock, marks its rows
-- with its claim ID the same way.
--
-- No foreign key to workflow_runs, unlike the other run tables: the claim writes a
-- history row without taking the run's lock, and a foreign key check would lock the
-- run row FOR KEY SHARE, which waits behind any event holding the run lock FOR UPDATE.
-- Rows are only ever inserted (by the engine) and dropped with their month. `seq` is a
-- plain sequence default (not an identity column), so that a partition created apart
-- and attached (CREATE TABLE ... LIKE ... INCLUDING DEFAULTS) numbers its rows the same.
CREATE SEQUENCE IF NOT EXISTS run_history_seq AS BIGINT;
CREATE TABLE IF NOT EXISTS run_history(
    run_id TEXT COLLATE "C" NOT NULL,
    seq BIGINT NOT NULL DEFAULT nextval('run_history_seq'),
    at TIMESTAMPTZ NOT NULL DEFAULT NOW(),  -- the database clock of the change's transaction
    kind TEXT NOT NULL,                      -- claimed, completed, failed, lease_expired, lease_lost, ...
    node_id TEXT,
    task_id TEXT COLLATE "C",
    attempt INT,                             -- the attempt the row is about
    worker TEXT,                             -- the worker (lease owner) concerned, when there is one
    request TEXT,                            -- the API call that wrote it (see above)
    detail JSONB,                            -- the error, the signal, what followed (re-queued, run finished)
    PRIMARY KEY (run_id, seq)
) PARTITION BY RANGE (run_id);

-- On a Citus coordinator whose run tables are distributed (sql/citus/V007), the history
-- is distributed with them, co-located by run ID, before it gets partitions (they
-- follow it). Citus's functions are only looked up when a Citus database reaches them.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
        IF EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = 'workflow_runs'::regclass) THEN
            PERFORM create_distributed_table('run_history', 'run_id', colocate_with => 'workflow_runs');
        END IF;
    END IF;
END;
$$;

-- How many of a task's attempts ended in an expired lease. attempt counts every
-- re-queue; the retry policy counts only handler failures (attempt - lease_expiries),
-- and a task fails once its expiries pass the node's max_lease_expiries. A constant
-- default: adding the column rewrites no partition.
ALTER TABLE task_instances ADD COLUMN IF NOT EXISTS lease_expiries INT NOT NULL DEFAULT 0;

-- The run-scoped, monthly-partitioned tables, referenced table first: the one list
-- the partition functions below create, drop, plan and repair.
CREATE OR REPLACE FUNCTION composer_run_tables() RETURNS TEXT[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT ARRAY['workflow_runs', 'task_instances', 'workflow_events', 'run_history']::TEXT[]
$$;

-- V009's function (each partition created on its own, then attached), same signature,
-- promise and locks, over composer_run_tables(): workflow_runs first, the others
-- reference it or follow it. run_history's partitions take its sequence default
-- (INCLUDING DEFAULTS) and get its primary key when attached.
CREATE OR REPLACE FUNCTION composer_ensure_partitions_from(first_month DATE, months_ahead INT DEFAULT 3)
RETURNS INT
LANGUAGE plpgsql AS $$
DECLARE
    month_wall TIMESTAMP;   -- first moment of the month, UTC wall clock
    tbl TEXT;
    part TEXT;
    created INT := 0;
BEGIN
    IF months_ahead < 0 THEN
        RAISE EXCEPTION 'months_ahead must be >= 0, got %', months_ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('composer_partitions'));
    FOR i IN 0..months_ahead LOOP
        month_wall := date_trunc('month', first_month::timestamp) + make_interval(months => i);
        FOREACH tbl IN ARRAY composer_run_tables() LOOP
            part := tbl || '_p' || to_char(month_wall, 'YYYYMM');
            IF to_regclass(format('%I', part)) IS NULL THEN
                EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                               'INCLUDING STORAGE INCLUDING COMPRESSION)%s',
                    part, tbl,
                    -- task_instances is the table that is updated in place (V005)
                    CASE WHEN tbl = 'task_instances' THEN ' WITH (fillfactor = 80)' ELSE '' END);
                EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                    tbl, part,
                    composer_uuid7_bound(month_wall AT TIME ZONE 'UTC'),
                    composer_uuid7_bound((month_wall + INTERVAL '1 month') AT TIME ZONE 'UTC'));
                created := created + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN created;
END;
$$;

-- V010's plan, same signature and rows, over every table of composer_run_tables() (the
-- two-argument form calls it unchanged).
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
                       array_position(composer_run_tables(), p.relname::text) AS table_order,
                       substring(c.relname FROM '_p(\d{6})$') AS suffix
                  FROM pg_inherits i
                  JOIN pg_class c ON c.oid = i.inhrelid
                  JOIN pg_class p ON p.oid = i.inhparent
                 WHERE p.oid = ANY(composer_run_tables()::regclass[])) s
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

-- V010's drop (lock every month the plan would drop, judge again under the locks, drop
-- what is still due), same signature and promise, over composer_run_tables(): the
-- plan's partitions (every run table's, workflow_runs first) are locked, the tables
-- other than workflow_runs are dropped first, then workflow_runs' month is detached
-- and dropped. The one-argument form calls it unchanged; CREATE OR REPLACE keeps the
-- privileges (owner only).
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
        RETURN NEXT p.month;
    END LOOP;
END;
$$;

-- V002's repair, same promise, over composer_run_tables(): referencing tables are
-- detached before the referenced one and attached after it.
CREATE OR REPLACE FUNCTION composer_repair_partition_bounds() RETURNS INT
LANGUAGE plpgsql AS $$
DECLARE
    tables TEXT[] := composer_run_tables();
    tbl TEXT;
    part RECORD;
    repaired INT := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('composer_partitions'));
    CREATE TEMP TABLE IF NOT EXISTS composer_misaligned(parent TEXT, child TEXT, lo TEXT, hi TEXT) ON COMMIT DROP;
    TRUNCATE composer_misaligned;
    FOR i IN REVERSE array_length(tables, 1)..1 LOOP
        tbl := tables[i];
        FOR part IN
            SELECT c.relname::text AS name,
                   pg_get_expr(c.relpartbound, c.oid) AS bound,
                   composer_suffix_month(substring(c.relname FROM '_p(\d{6})$')) AS month
              FROM pg_inherits inh JOIN pg_class c ON c.oid = inh.inhrelid
             WHERE inh.inhparent = tbl::regclass
        LOOP
            CONTINUE WHEN part.month IS NULL;
            IF part.bound IS DISTINCT FROM format('FOR VALUES FROM (%L) TO (%L)',
                    composer_uuid7_bound(part.month::timestamp AT TIME ZONE 'UTC'),
                    composer_uuid7_bound((part.month + INTERVAL '1 month') AT TIME ZONE 'UTC')) THEN
                EXECUTE format('ALTER TABLE %I DETACH PARTITION %I', tbl, part.name);
                INSERT INTO composer_misaligned VALUES (tbl, part.name,
                    composer_uuid7_bound(part.month::timestamp AT TIME ZONE 'UTC'),
                    composer_uuid7_bound((part.month + INTERVAL '1 month') AT TIME ZONE 'UTC'));
            END IF;
        END LOOP;
    END LOOP;
    FOR part IN
        SELECT * FROM composer_misaligned ORDER BY array_position(tables, parent), child
    LOOP
        EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       part.parent, part.child, part.lo, part.hi);
        repaired := repaired + 1;
    END LOOP;
    RETURN repaired;
END;
$$;

-- CREATE OR REPLACE resets a function's SET clauses: on Citus, the partition functions
-- keep running in sequential mode (sql/citus/V007 says why).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
        ALTER FUNCTION composer_ensure_partitions_from(DATE, INT) SET citus.multi_shard_modify_mode = 'sequential';
        ALTER FUNCTION composer_drop_partitions(TIMESTAMPTZ, INTERVAL)
            SET citus.multi_shard_modify_mode = 'sequential';
        ALTER FUNCTION composer_drop_partitions(TIMESTAMPTZ) SET citus.multi_shard_modify_mode = 'sequential';
        ALTER FUNCTION composer_repair_partition_bounds() SET citus.multi_shard_modify_mode = 'sequential';
    END IF;
END;
$$;

-- A history partition for every month that already has runs (the months ahead too).
DO $$
DECLARE
    suffix TEXT;
BEGIN
    FOR suffix IN
        SELECT substring(c.relname FROM '_p(\d{6})$')
          FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'workflow_runs'::regclass
    LOOP
        CONTINUE WHEN composer_suffix_month(suffix) IS NULL;
        PERFORM composer_ensure_partitions_from(composer_suffix_month(suffix), 0);
    END LOOP;
END;
$$;

-- The engine appends history and reads it; the reader role reads it.
GRANT SELECT, INSERT ON run_history TO composer_ops_engine;
GRANT USAGE ON SEQUENCE run_history_seq TO composer_ops_engine;
GRANT SELECT ON run_history TO composer_ops_reader;
