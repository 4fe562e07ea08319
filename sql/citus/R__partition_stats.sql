-- Citus only: composer_partition_stats() reads the shards. Applied on a Citus
-- coordinator after the plain repeatable files, so this body replaces the one of
-- sql/R__partitions.sql there (same signature and rows).
--
-- On a Citus coordinator the partitions of the run tables are empty shells; their rows
-- are in shards on the worker nodes, each a table named after its partition with the
-- shard's number appended (task_instances_p202612_102008). This asks every node once
-- (run_command_on_all_nodes: one query per node, in parallel) for the estimate and
-- sizes of the shards it holds, and returns them per partition and per node
-- ('host:port'), so the retention plan and the partition inventory count the data where
-- it is, and the partition_sizes report can show how it is spread. The coordinator's
-- shells are left out; shards placed on the coordinator (a cluster whose coordinator
-- also holds shards) are counted under its name.
CREATE OR REPLACE FUNCTION composer_partition_stats()
RETURNS TABLE(partition TEXT, node TEXT, rows BIGINT, heap_bytes BIGINT, index_bytes BIGINT, toast_bytes BIGINT,
              total_bytes BIGINT)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    command TEXT;
BEGIN
    command := format($cmd$
        SELECT COALESCE(json_agg(json_build_array(
                   regexp_replace(c.relname, '_[0-9]+$', ''),
                   (CASE WHEN c.reltuples >= 0 THEN c.reltuples ELSE pg_stat_get_live_tuples(c.oid) END)::bigint,
                   pg_table_size(c.oid) - COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),
                   pg_indexes_size(c.oid),
                   COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),
                   pg_total_relation_size(c.oid))), '[]')
          FROM pg_class c
         WHERE c.relkind = 'r' AND c.relname ~ %L
    $cmd$, '^(' || array_to_string(composer_run_tables(), '|') || ')_p[0-9]{6}_[0-9]+$');
    RETURN QUERY
        SELECT s.value->>0, n.nodename || ':' || n.nodeport,
               sum((s.value->>1)::bigint)::bigint, sum((s.value->>2)::bigint)::bigint,
               sum((s.value->>3)::bigint)::bigint, sum((s.value->>4)::bigint)::bigint,
               sum((s.value->>5)::bigint)::bigint
          FROM run_command_on_all_nodes(command) r
          JOIN pg_dist_node n ON n.nodeid = r.nodeid
         CROSS JOIN LATERAL json_array_elements(r.result::json) s
         WHERE r.success
         GROUP BY 1, 2;
END;
$$;
