-- V015: partition rows and bytes from one function, composer_partition_stats(), which
-- the retention plan and the partition inventory (composer_ops/repo/partitions.py) read.
--
-- One row per partition of the run tables and per node holding its data: on a single
-- server one node, 'local', read from pg_class and the size functions. A Citus
-- coordinator holds only empty shells of the partitions, its data being in the shards
-- on the worker nodes, so sql/citus/V016 replaces this function there with one that
-- reads the shards (and reports them per node). The plan itself is the same on both.
--
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

-- V012's plan, same signature and rows, with rows and bytes from composer_partition_stats()
-- (the two-argument form calls it unchanged).
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
