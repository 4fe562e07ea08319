-- V002: make the partition functions UTC-correct whatever the session TimeZone is.
--
-- The seed's functions did their month arithmetic on TIMESTAMPTZ values, and
-- PostgreSQL adds months to a TIMESTAMPTZ in the *session* time zone:
--   * composer_ensure_partitions: with TimeZone=America/New_York and the current
--     month 2026-12, "2026-12-01 00:00 UTC + 1 month" is 2026-12-31 00:00 UTC, so
--     p202612 was "created" twice (the second skipped) and February 2027 never was;
--     in November the December bound came out at 01:00 UTC instead of 00:00.
--   * composer_drop_partitions: to_timestamp(suffix, 'YYYYMM') reads the month in
--     the session zone, then the AT TIME ZONE / + interval dance moved the cut-off
--     by hours (New York) or days (Asia/Tokyo: the end of 2026-03 came out as
--     2026-03-28 15:00 UTC), so a month could be dropped before it was over.
-- Here all calendar arithmetic is done on TIMESTAMP WITHOUT TIME ZONE (UTC wall
-- clock) and converted to an instant once, with AT TIME ZONE 'UTC'.
-- tests/integration/test_partitions.py shows the V001 behaviour and the fix.

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
-- month that contains `first_month`, for all three run-scoped tables. Past months
-- are allowed (the history backfill needs them). Same advisory lock as the seed's.
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
        FOREACH tbl IN ARRAY ARRAY['workflow_runs', 'task_instances', 'workflow_events'] LOOP
            part := tbl || '_p' || to_char(month_wall, 'YYYYMM');
            IF to_regclass(format('%I', part)) IS NULL THEN
                EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)',
                    part, tbl,
                    composer_uuid7_bound(month_wall AT TIME ZONE 'UTC'),
                    composer_uuid7_bound((month_wall + INTERVAL '1 month') AT TIME ZONE 'UTC'));
                created := created + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN created;
END;
$$;

-- The seed's entry point, same signature and promise: this UTC month and N ahead.
CREATE OR REPLACE FUNCTION composer_ensure_partitions(months_ahead INT DEFAULT 3) RETURNS INT
LANGUAGE sql AS $$
    SELECT composer_ensure_partitions_from((NOW() AT TIME ZONE 'UTC')::date, months_ahead)
$$;

-- The seed's retention, same signature and promise, with a UTC-correct cut-off:
-- a month is dropped only when its last instant is at or before older_than.
CREATE OR REPLACE FUNCTION composer_drop_partitions(older_than TIMESTAMPTZ) RETURNS SETOF TEXT
LANGUAGE plpgsql AS $$
DECLARE
    part RECORD;
    suffix TEXT;
    active BOOLEAN;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('composer_partitions'));
    FOR part IN
        SELECT c.relname
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'workflow_runs'::regclass
         ORDER BY c.relname
    LOOP
        suffix := substring(part.relname FROM '_p(\d{6})$');
        CONTINUE WHEN composer_suffix_month(suffix) IS NULL
            OR (composer_suffix_month(suffix) + INTERVAL '1 month') AT TIME ZONE 'UTC' > older_than;

        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE status IN (''RUNNING'', ''PENDING''))',
                       part.relname) INTO active;
        IF active THEN
            RAISE NOTICE 'keeping partition %: it still has active runs', part.relname;
            CONTINUE;
        END IF;

        -- Referencing tables first, so their foreign keys never see orphans.
        EXECUTE format('DROP TABLE IF EXISTS %I', 'workflow_events_p' || suffix);
        EXECUTE format('DROP TABLE IF EXISTS %I', 'task_instances_p' || suffix);
        EXECUTE format('ALTER TABLE workflow_runs DETACH PARTITION %I', part.relname);
        EXECUTE format('DROP TABLE %I', part.relname);
        RETURN NEXT suffix;
    END LOOP;
END;
$$;

-- V001's own `SELECT composer_ensure_partitions(3)` ran in the migrating session's
-- TimeZone, so a database first migrated outside UTC has partitions whose bounds do
-- not match their names (off by an hour around DST, or a missing month). Re-attach
-- every such partition with the bounds its name promises: detach the referencing
-- tables first, attach the referenced one first, so foreign keys always hold. A
-- partition whose rows do not fit its corrected bounds fails the migration (the
-- transaction rolls back) instead of moving rows silently.
CREATE OR REPLACE FUNCTION composer_repair_partition_bounds() RETURNS INT
LANGUAGE plpgsql AS $$
DECLARE
    tbl TEXT;
    part RECORD;
    repaired INT := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('composer_partitions'));
    CREATE TEMP TABLE IF NOT EXISTS composer_misaligned(parent TEXT, child TEXT, lo TEXT, hi TEXT) ON COMMIT DROP;
    TRUNCATE composer_misaligned;
    FOREACH tbl IN ARRAY ARRAY['workflow_events', 'task_instances', 'workflow_runs'] LOOP
        FOR part IN
            SELECT c.relname::text AS name,
                   pg_get_expr(c.relpartbound, c.oid) AS bound,
                   composer_suffix_month(substring(c.relname FROM '_p(\d{6})$')) AS month
              FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = tbl::regclass
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
        SELECT * FROM composer_misaligned
         ORDER BY array_position(ARRAY['workflow_runs', 'task_instances', 'workflow_events'], parent), child
    LOOP
        EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       part.parent, part.child, part.lo, part.hi);
        repaired := repaired + 1;
    END LOOP;
    RETURN repaired;
END;
$$;

SELECT composer_repair_partition_bounds();
-- ...and create any month V001 skipped.
SELECT composer_ensure_partitions(3);
