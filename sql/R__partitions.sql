-- Partitions of the run tables: their names, bounds and creation. A repeatable file
-- (docs/architecture.md, "where new code goes"): `composer-ops migrate` runs it again,
-- after the V files, whenever any migration or repeatable file is applied.
--
-- Run data is range-partitioned by month on the run ID (a UUIDv7, whose text form
-- sorts by creation time). All calendar arithmetic is done on TIMESTAMP WITHOUT TIME
-- ZONE (the UTC wall clock) and turned into an instant once, with AT TIME ZONE 'UTC',
-- so it is correct whatever the session's TimeZone is.

-- The run-scoped, monthly-partitioned tables, referenced table first: the one list
-- the partition functions create, drop, plan and repair.
CREATE OR REPLACE FUNCTION composer_run_tables() RETURNS TEXT[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT ARRAY['workflow_runs', 'task_instances', 'workflow_events', 'run_history']::TEXT[]
$$;

-- The seed's function: the smallest UUIDv7 text with a timestamp >= ts, the partition
-- boundary for runs created from ts onwards.
CREATE OR REPLACE FUNCTION composer_uuid7_bound(ts TIMESTAMPTZ) RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $$
    SELECT substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-0000-0000-000000000000'
      FROM (SELECT lpad(to_hex(floor(extract(epoch FROM ts) * 1000)::BIGINT), 12, '0') AS h) b
$$;

-- Whether month p_month's (YYYYMM) workflow_runs and task_instances partitions are both
-- attached with exactly that month's bounds: only then does a run ID's month name the
-- partition holding it, which the per-month functions of the claim (sql/R__claim.sql)
-- and of the event's write (sql/R__apply.sql) rely on. False for a malformed p_month;
-- not called on Citus, whose claim and write are their own.
CREATE OR REPLACE FUNCTION composer_month_aligned(p_month TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql STABLE AS $$
DECLARE
    lo TEXT;
    hi TEXT;
BEGIN
    IF composer_suffix_month(p_month) IS NULL THEN
        RETURN false;
    END IF;
    lo := composer_uuid7_bound(to_date(p_month, 'YYYYMM')::timestamp AT TIME ZONE 'UTC');
    hi := composer_uuid7_bound((to_date(p_month, 'YYYYMM') + INTERVAL '1 month') AT TIME ZONE 'UTC');
    RETURN (SELECT count(*) = 2
              FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE (c.oid, i.inhparent) IN ((to_regclass(format('%I', 'workflow_runs_p' || p_month)),
                                             'workflow_runs'::regclass),
                                            (to_regclass(format('%I', 'task_instances_p' || p_month)),
                                             'task_instances'::regclass))
               AND pg_get_expr(c.relpartbound, c.oid) = format('FOR VALUES FROM (%L) TO (%L)', lo, hi));
END;
$$;

-- How partition `part`'s bounds differ from those of the month its name ends in
-- (_pYYYYMM): NULL when they are exactly that month's; else its real bounds, as UTC
-- instants ('[2027-04-01 00:00, 2027-05-01 00:00) UTC'), or as declared when they are
-- not UUIDv7 texts. The one check of it: the partition reports flag such a partition
-- (repo/partitions.py, CATALOG_SQL: bounds_match) and the retention plan refuses its
-- month (sql/R__retention.sql), which its name would misjudge.
CREATE OR REPLACE FUNCTION composer_misaligned_bounds(part REGCLASS) RETURNS TEXT
LANGUAGE plpgsql STABLE AS $$
DECLARE
    bound TEXT;
    month DATE;
    lo TEXT;
    hi TEXT;
BEGIN
    SELECT pg_get_expr(c.relpartbound, c.oid), composer_suffix_month(substring(c.relname FROM '_p(\d{6})$'))
      INTO bound, month FROM pg_class c WHERE c.oid = part;
    IF month IS NOT NULL AND bound = format('FOR VALUES FROM (%L) TO (%L)',
            composer_uuid7_bound(month::timestamp AT TIME ZONE 'UTC'),
            composer_uuid7_bound((month + INTERVAL '1 month') AT TIME ZONE 'UTC')) THEN
        RETURN NULL;
    END IF;
    lo := substring(bound FROM 'FROM \(''([0-9a-f]{8}-[0-9a-f]{4})-[^'']*''\)');
    hi := substring(bound FROM 'TO \(''([0-9a-f]{8}-[0-9a-f]{4})-[^'']*''\)');
    IF lo IS NULL OR hi IS NULL THEN
        RETURN COALESCE(bound, 'no bounds');
    END IF;
    RETURN format('[%s, %s) UTC',
                  to_char(to_timestamp(('x' || lpad(replace(lo, '-', ''), 16, '0'))::bit(64)::bigint / 1000.0)
                          AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI'),
                  to_char(to_timestamp(('x' || lpad(replace(hi, '-', ''), 16, '0'))::bit(64)::bigint / 1000.0)
                          AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI'));
END;
$$;

-- The first instant (UTC) of the month that contains `day`.
CREATE OR REPLACE FUNCTION composer_month_start(day DATE) RETURNS TIMESTAMPTZ
LANGUAGE sql IMMUTABLE AS $$
    SELECT date_trunc('month', day::timestamp) AT TIME ZONE 'UTC'
$$;

-- The UTC month (first day) a partition suffix "YYYYMM" stands for; NULL if malformed.
CREATE OR REPLACE FUNCTION composer_suffix_month(suffix TEXT) RETURNS DATE
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN suffix ~ '^\d{6}$' AND substr(suffix, 5, 2)::int BETWEEN 1 AND 12
                THEN to_date(suffix, 'YYYYMM') END
$$;

-- Create partitions for `months_ahead + 1` consecutive UTC months starting with the
-- month that contains `first_month`, for every run table, workflow_runs first (the
-- others reference it or follow it). Past months are allowed (the history backfill
-- needs them). The advisory lock makes concurrent callers safe; there is deliberately
-- no DEFAULT partition (one holding rows would block creating later months).
--
-- Each partition is created on its own and then attached: CREATE TABLE ... PARTITION
-- OF takes ACCESS EXCLUSIVE on the parent, so it would wait behind any reader of the
-- parent and queue every engine write behind itself; ATTACH needs only SHARE UPDATE
-- EXCLUSIVE on the parent (plus SHARE ROW EXCLUSIVE on workflow_runs for the foreign
-- keys, bounded by the caller's lock_timeout, composer_ops/repo/partitions.py). The
-- new tables are empty, so ATTACH's validation and index builds cost nothing;
-- tests/integration/test_partitions_upkeep.py compares the result with PARTITION OF.
-- task_instances partitions get fillfactor 80: heartbeats change only
-- lease_expires_at, which no index contains, and the free fifth of each page lets
-- them be HOT updates (partitioned tables take no storage parameters, so each
-- partition gets it). Each month gets the claim's function of its own
-- (composer_claim_month, sql/R__claim.sql) and the event's lock and load
-- (composer_load_month, sql/R__apply.sql). The engine role gets SELECT and UPDATE on the
-- new workflow_runs and task_instances partitions: it names a run's month partition in
-- its per-run statements (repo/partitions.py, run_tables; the event's fenced updates,
-- repo/writes.py), and PostgreSQL checks a named
-- partition's own privileges. On Citus a GRANT on a distributed table reaches its shards.
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
                    -- task_instances is the table that is updated in place (see above)
                    CASE WHEN tbl = 'task_instances' THEN ' WITH (fillfactor = 80)' ELSE '' END);
                EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                    tbl, part,
                    composer_uuid7_bound(month_wall AT TIME ZONE 'UTC'),
                    composer_uuid7_bound((month_wall + INTERVAL '1 month') AT TIME ZONE 'UTC'));
                IF tbl IN ('workflow_runs', 'task_instances') THEN
                    EXECUTE format('GRANT SELECT, UPDATE ON %I TO composer_ops_engine', part);
                END IF;
                created := created + 1;
            END IF;
        END LOOP;
        PERFORM composer_claim_month(to_char(month_wall, 'YYYYMM'));
        PERFORM composer_load_month(to_char(month_wall, 'YYYYMM'));
    END LOOP;
    RETURN created;
END;
$$;

-- The seed's entry point, same signature and promise: this UTC month and
-- `months_ahead` after it. It is the one partition function the engine role may call
-- (the coordinator's hourly upkeep), so it runs as its owner (SECURITY DEFINER), takes
-- one bounded integer and names and bounds the partitions itself; its search_path is
-- fixed to its schema with pg_temp last (set below, after every CREATE OR REPLACE,
-- which resets it), so a caller cannot shadow the tables or functions it uses.
-- tests/integration/test_roles.py checks both.
CREATE OR REPLACE FUNCTION composer_ensure_partitions(months_ahead INT DEFAULT 3) RETURNS INT
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF months_ahead IS NULL OR months_ahead < 0 OR months_ahead > 120 THEN
        RAISE EXCEPTION 'months_ahead must be between 0 and 120, got %', months_ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN composer_ensure_partitions_from((now() AT TIME ZONE 'UTC')::date, months_ahead);
END;
$$;

-- Re-attach every partition whose bounds do not match the month its name promises
-- (a partition made by hand, or by the seed's session-time-zone arithmetic):
-- referencing tables are detached before the referenced one and attached after it,
-- so foreign keys always hold. A partition whose rows do not fit its corrected bounds
-- fails the call (the transaction rolls back) instead of moving rows silently.
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

-- Rows and bytes of every partition of the run tables, per node holding its data: on
-- a single server one node, 'local', read from pg_class and the size functions (on
-- Citus sql/citus/R__partition_stats.sql replaces it with one that reads the shards).
-- The retention plan and the partition inventory (repo/partitions.py) read it.
-- rows: the planner's estimate (reltuples; the live-tuple counter for a partition
-- never analysed); heap_bytes: the table without its TOAST (main fork, free space map,
-- visibility map); index_bytes; toast_bytes: the TOAST table with its index;
-- total_bytes: all of them.
CREATE OR REPLACE FUNCTION composer_partition_stats()
RETURNS TABLE(partition TEXT, node TEXT, rows BIGINT, heap_bytes BIGINT, index_bytes BIGINT, toast_bytes BIGINT,
              total_bytes BIGINT)
LANGUAGE sql STABLE AS $$
    SELECT c.relname::text, 'local',
           (CASE WHEN c.reltuples >= 0 THEN c.reltuples ELSE pg_stat_get_live_tuples(c.oid) END)::bigint,
           pg_table_size(c.oid) - COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),
           pg_indexes_size(c.oid),
           COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),
           pg_total_relation_size(c.oid)
      FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
     WHERE i.inhparent = ANY(composer_run_tables()::regclass[])
$$;

-- Only the owner creates past months or repairs bounds; the engine role creates the
-- coming months through composer_ensure_partitions only.
REVOKE ALL ON FUNCTION composer_ensure_partitions(INT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_ensure_partitions(INT) TO composer_ops_engine;
REVOKE EXECUTE ON FUNCTION composer_ensure_partitions_from(DATE, INT) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION composer_repair_partition_bounds() FROM PUBLIC;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION composer_ensure_partitions(INT) SET search_path = %I, pg_temp',
                   current_schema());
    -- On Citus, DDL on a distributed table fans out over several connections per node,
    -- after which Citus refuses the statements of the same transaction that must see
    -- it over one connection; these functions create or drop several partitions in one
    -- transaction, so they run in sequential mode (one connection per node, in order).
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
        ALTER FUNCTION composer_ensure_partitions_from(DATE, INT) SET citus.multi_shard_modify_mode = 'sequential';
        ALTER FUNCTION composer_repair_partition_bounds() SET citus.multi_shard_modify_mode = 'sequential';
    END IF;
END;
$$;

-- The claim's and the event's functions of every month there is, made again from
-- the current text, and none for a month that is gone (sql/R__claim.sql
-- composer_claim_month, sql/R__apply.sql composer_load_month).
DO $$
DECLARE
    m TEXT;
BEGIN
    FOR m IN SELECT substring(c.relname FROM '_p(\d{6})$')
               FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'task_instances'::regclass
             UNION
             SELECT substring(f.proname FROM '^composer_(?:claim_tasks|load_run)_p(\d{6})$')
               FROM pg_proc f
              WHERE f.proname ~ '^composer_(claim_tasks|load_run)_p\d{6}$'
                AND f.pronamespace = current_schema()::regnamespace LOOP
        PERFORM composer_claim_month(m, true);
        PERFORM composer_load_month(m, true);
    END LOOP;
END;
$$;

-- The seed's initial partitions: this month and three ahead (only those missing).
SELECT composer_ensure_partitions(3);
