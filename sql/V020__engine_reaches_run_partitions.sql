-- V020: the engine role may read and update the month partitions of workflow_runs and
-- task_instances by name.
--
-- The engine's statements on one run's own rows (its lock, its tasks, their fenced
-- updates, the run's finish, heartbeats) name the run's month partition rather than the
-- partitioned table (composer_ops/repo/partitions.py, run_tables): on the partitioned
-- table such a statement is planned at every call, since a cached generic plan would lock
-- every month before pruning. PostgreSQL checks a partition's own privileges when it is
-- named, and V006 granted none on partitions (they were reached only through their
-- parents), so the engine role was refused ("permission denied for table
-- workflow_runs_p..."). It gets SELECT and UPDATE on those two tables' partitions, the
-- privileges it already holds on their parents (it inserts through the parents, and
-- reaches workflow_events and run_history only through theirs): on every partition there
-- is now, and from composer_ensure_partitions_from on every one it creates. On Citus a
-- GRANT on a distributed table is carried to its shards.
--
-- The engine also checks the privileges before it names a partition (has_table_privilege),
-- and goes through the partitioned table without them, so a role granted the parents only
-- keeps working, at the old cost.

-- V012's function, same signature, promise and locks, plus the grants.
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
                IF tbl IN ('workflow_runs', 'task_instances') THEN
                    EXECUTE format('GRANT SELECT, UPDATE ON %I TO composer_ops_engine', part);
                END IF;
                created := created + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN created;
END;
$$;

-- CREATE OR REPLACE resets a function's SET clauses: on Citus it keeps running in
-- sequential mode (sql/citus/V007 says why).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
        ALTER FUNCTION composer_ensure_partitions_from(DATE, INT) SET citus.multi_shard_modify_mode = 'sequential';
    END IF;
END;
$$;

-- The partitions there are now.
DO $$
DECLARE
    part TEXT;
BEGIN
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
        PERFORM set_config('citus.multi_shard_modify_mode', 'sequential', true);
    END IF;
    FOR part IN
        SELECT c.relname::text
          FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent IN ('workflow_runs'::regclass, 'task_instances'::regclass)
         ORDER BY 1
    LOOP
        EXECUTE format('GRANT SELECT, UPDATE ON %I TO composer_ops_engine', part);
    END LOOP;
END;
$$;
