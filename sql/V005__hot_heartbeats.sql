-- V005: make lease heartbeats HOT updates (SPEC section 10).
--
-- The seed's comment on task_instances says it plainly: every index is rewritten by
-- a non-HOT update, and indexing the state/lease columns prevents HOT. Yet its lease
-- sweeper index was ON (lease_expires_at) WHERE state = 'RUNNING', and a heartbeat
-- changes exactly lease_expires_at, so measured on PostgreSQL 18 0 of 1,000
-- heartbeats were HOT: each one wrote a new entry into all four indexes of the row
-- and left four dead ones behind, for the most frequent update a long task makes.
-- Two things were needed (bench/hot.py measures both, docs/performance.md has the
-- figures):
--
-- 1. An index for the sweeper that does not contain lease_expires_at. RUNNING rows
--    are few (bounded by the workers' total concurrency), so the sweeper can read all
--    of them through a partial index and filter on lease_expires_at; the key is
--    run_id, which never changes. The claim (PENDING -> RUNNING) and the completion
--    change `state`, a column of the partial indexes' predicates, so they were never
--    HOT and still are not; that is the price of the partial indexes that keep the
--    background loops' scans small, and it is unchanged here (the new index gets one
--    entry per claim, exactly like the one it replaces).
--
-- 2. Room on the page. A HOT update must put the new row version on the same page;
--    with the default fillfactor (100) freshly inserted pages are full and even an
--    update that touches no indexed column rarely finds room (37 of 1,000 in the
--    issue's measurement). 80 leaves a fifth of each page for new versions, which
--    page pruning recycles, so a task can heartbeat indefinitely without moving.
--    Partitioned tables take no storage parameters (PostgreSQL refuses
--    `ALTER TABLE task_instances SET (fillfactor = ...)`, on 15 as on 18), so the
--    setting is put on every existing task_instances partition here, and
--    composer_ensure_partitions_from now creates new ones WITH (fillfactor = 80).
--    An existing partition keeps its full pages until they are rewritten; new rows
--    (all of this month's and every later month's work) get the room.
--
-- On a large live database this migration builds the new index over every
-- task_instances partition while holding a lock that blocks writes to the table
-- (an index on a partitioned table cannot be built CONCURRENTLY, and a migration is
-- one transaction). The scan is sequential and writes only the RUNNING rows. If that
-- pause is too long, build each partition's index by hand first with
-- CREATE INDEX CONCURRENTLY ... ON task_instances_pYYYYMM (run_id) WHERE state = 'RUNNING',
-- then this migration's CREATE INDEX attaches them instead of building.

-- Lease sweeper: RUNNING tasks (few), read through this index and filtered on
-- lease_expires_at, which is deliberately not indexed so heartbeats stay HOT.
CREATE INDEX IF NOT EXISTS idx_task_instances_running
    ON task_instances (run_id)
    WHERE state = 'RUNNING';
DROP INDEX IF EXISTS idx_task_instances_running_lease;

-- Room for HOT updates on every existing partition of task_instances.
DO $$
DECLARE
    part RECORD;
BEGIN
    FOR part IN
        SELECT c.relname
          FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'task_instances'::regclass
    LOOP
        EXECUTE format('ALTER TABLE %I SET (fillfactor = 80)', part.relname);
    END LOOP;
END;
$$;

-- V002's function, same signature and promise (months_ahead + 1 consecutive UTC
-- months from the month containing first_month, past months allowed, same advisory
-- lock), with one change: task_instances partitions are created WITH (fillfactor = 80).
-- CREATE OR REPLACE keeps V004's privileges (not executable by PUBLIC).
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
                EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)%s',
                    part, tbl,
                    composer_uuid7_bound(month_wall AT TIME ZONE 'UTC'),
                    composer_uuid7_bound((month_wall + INTERVAL '1 month') AT TIME ZONE 'UTC'),
                    -- task_instances is the table that is updated in place (see above)
                    CASE WHEN tbl = 'task_instances' THEN ' WITH (fillfactor = 80)' ELSE '' END);
                created := created + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN created;
END;
$$;
