-- V009: partition upkeep that never queues the engine behind a reader.
--
-- CREATE TABLE ... PARTITION OF takes an ACCESS EXCLUSIVE lock on the parent table.
-- While any transaction reads the parent (one open `SELECT count(*) FROM
-- task_instances` is enough), the CREATE waits for that lock, and every later start,
-- completion and signal (which all need ROW EXCLUSIVE on the parent) queues behind the
-- waiting CREATE until the reader ends.
--
-- A partition created on its own and then attached needs only SHARE UPDATE EXCLUSIVE
-- on the parent, which conflicts with neither readers (ACCESS SHARE) nor writers (ROW
-- EXCLUSIVE); measured on PostgreSQL 15 and 18, it completes at once behind a held
-- reader of either table. Attaching a task_instances or workflow_events partition
-- also adds the foreign key to workflow_runs, which takes SHARE ROW EXCLUSIVE on
-- workflow_runs and so waits for transactions writing it (short engine events); the
-- caller sets a lock_timeout (composer_ops/repo/partitions.py) so that wait is bounded
-- and retried later instead of stalling starts behind it. The new tables are empty,
-- so ATTACH's validation scan and the indexes it creates to match the parent's cost
-- nothing.
--
-- Same signature, promise, advisory lock and names as V005's function; partitions
-- come out identical (columns, collations, defaults, NOT NULL, indexes, foreign keys,
-- task_instances' fillfactor): tests/integration/test_upkeep_locks.py compares them.
-- CREATE OR REPLACE keeps V004's privileges (not executable by PUBLIC) and
-- composer_ensure_partitions (V006, SECURITY DEFINER) calls it unchanged.
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
        -- workflow_runs first: the other two reference it
        FOREACH tbl IN ARRAY ARRAY['workflow_runs', 'task_instances', 'workflow_events'] LOOP
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
