-- Citus only: the coordinator's scans and its webhook prune, one delegated call per worker
-- node (docs/scaling.md, "The coordinator's pass on Citus"). The coordinator calls each
-- function with a key that hashes to a shard of the node (repo/citus.py, stream keys);
-- Citus delegates the call there (create_distributed_function below), and the function
-- reads or deletes in that node's own shards only, by their shard names: a plain local
-- transaction of one node, committed in one phase, with no connection to any other node.
-- Called in autocommit: inside a transaction block Citus would pin every statement to
-- p_key's own run.

-- The candidates of the coordinator's timers, lease sweeper and start timeouts on this
-- node (composer_ops/repo/citus_scan.py): each kind in p_kinds ('timer', 'lease',
-- 'start'), up to p_limit rows of it, in the order of the single server's statement
-- (repo/signals.py due_waits, repo/tasks.py expired_leases, repo/outbox.py unstarted),
-- with the same predicates: p_now is the coordinator's clock, p_floor the active floor
-- (compared as text, as there: a run ID that is not a UUIDv7 is seen as the single
-- server sees it), the p_skip_* arrays the keys the coordinator is backing off. The
-- rows are hints: the coordinator handles each under its run's lock, where it is
-- checked again. Each kind is one statement over the node's shards (UNION ALL of one
-- branch per shard, each through its partial index), planned for these values.
CREATE OR REPLACE FUNCTION composer_scan_node(p_key TEXT, p_now TIMESTAMPTZ, p_floor TEXT, p_limit INT,
                                              p_kinds TEXT[], p_skip_timers TEXT[], p_skip_leases TEXT[],
                                              p_skip_starts TEXT[])
RETURNS TABLE(kind TEXT, run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, lease_owner TEXT,
              timed_out BOOLEAN, at TIMESTAMPTZ)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_runs TEXT[];        -- the node's workflow_runs shards, paired with
    v_tasks TEXT[];       -- its task_instances shards (the same hash range)
    v_outbox TEXT[];
    v_sql TEXT;
BEGIN
    SELECT array_agg(shard_name('workflow_runs'::regclass, r.shardid) ORDER BY r.shardid),
           array_agg(shard_name('task_instances'::regclass, t.shardid) ORDER BY r.shardid)
      INTO v_runs, v_tasks
      FROM pg_dist_shard r
      JOIN pg_dist_shard t ON t.logicalrelid = 'task_instances'::regclass AND t.shardminvalue = r.shardminvalue
      JOIN pg_dist_placement p ON p.shardid = r.shardid
     WHERE r.logicalrelid = 'workflow_runs'::regclass AND p.groupid = (SELECT groupid FROM pg_dist_local_group);
    SELECT array_agg(shard_name('task_outbox'::regclass, s.shardid) ORDER BY s.shardid)
      INTO v_outbox
      FROM pg_dist_shard s JOIN pg_dist_placement p ON p.shardid = s.shardid
     WHERE s.logicalrelid = 'task_outbox'::regclass AND p.groupid = (SELECT groupid FROM pg_dist_local_group);

    IF 'timer' = ANY(p_kinds) AND v_tasks IS NOT NULL THEN
        SELECT string_agg(format($q$(SELECT t.run_id, t.id, t.node_id, t.wake_at
                                       FROM %1$s t JOIN %2$s r ON r.id = t.run_id
                                      WHERE t.state = 'WAITING' AND t.wake_at <= $1 AND t.id <> ALL($2)
                                        AND t.run_id >= $3 AND r.id >= $3
                                        AND r.deleted_at IS NULL AND r.status IN ('PENDING', 'RUNNING')
                                      ORDER BY t.wake_at LIMIT $4)$q$, tk, rn), ' UNION ALL ')
          INTO v_sql
          FROM unnest(v_tasks, v_runs) AS u(tk, rn);
        RETURN QUERY EXECUTE 'SELECT ''timer''::text, x.run_id, x.id, x.node_id, NULL::int, NULL::text, NULL::boolean, '
                             'x.wake_at FROM (' || v_sql || ') x ORDER BY x.wake_at LIMIT $4'
            USING p_now, p_skip_timers, p_floor, p_limit;
    END IF;

    IF 'lease' = ANY(p_kinds) AND v_tasks IS NOT NULL THEN
        SELECT string_agg(format($q$(SELECT t.run_id, t.id, t.node_id, t.attempt, t.lease_owner,
                                            COALESCE(t.lease_expires_at >= t.run_deadline_at, false) AS timed_out,
                                            t.lease_expires_at
                                       FROM %1$s t JOIN %2$s r ON r.id = t.run_id
                                      WHERE t.state = 'RUNNING' AND t.lease_expires_at <= $1
                                        AND t.id || ':' || t.attempt <> ALL($2)
                                        AND t.run_id >= $3 AND r.id >= $3
                                        AND r.deleted_at IS NULL AND r.status IN ('PENDING', 'RUNNING')
                                      ORDER BY t.lease_expires_at LIMIT $4)$q$, tk, rn), ' UNION ALL ')
          INTO v_sql
          FROM unnest(v_tasks, v_runs) AS u(tk, rn);
        RETURN QUERY EXECUTE 'SELECT ''lease''::text, x.run_id, x.id, x.node_id, x.attempt, x.lease_owner, '
                             'x.timed_out, x.lease_expires_at FROM (' || v_sql || ') x '
                             'ORDER BY x.lease_expires_at LIMIT $4'
            USING p_now, p_skip_leases, p_floor, p_limit;
    END IF;

    IF 'start' = ANY(p_kinds) AND v_outbox IS NOT NULL THEN
        SELECT string_agg(format($q$(SELECT o.run_id, o.task_id, o.attempt, o.start_by FROM %1$s o
                                      WHERE o.start_by <= $1 AND o.task_id || ':' || o.attempt <> ALL($2)
                                      ORDER BY o.start_by LIMIT $3)$q$, ob), ' UNION ALL ')
          INTO v_sql
          FROM unnest(v_outbox) AS u(ob);
        RETURN QUERY EXECUTE 'SELECT ''start''::text, x.run_id, x.task_id, NULL::text, x.attempt, NULL::text, '
                             'NULL::boolean, x.start_by FROM (' || v_sql || ') x ORDER BY x.start_by LIMIT $3'
            USING p_now, p_skip_starts, p_limit;
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION composer_scan_node(TEXT, TIMESTAMPTZ, TEXT, INT, TEXT[], TEXT[], TEXT[], TEXT[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_scan_node(TEXT, TIMESTAMPTZ, TEXT, INT, TEXT[], TEXT[], TEXT[], TEXT[])
    TO composer_ops_engine;
SELECT create_distributed_function('composer_scan_node(text, timestamptz, text, int, text[], text[], text[], text[])',
                                   'p_key', colocate_with => 'workflow_runs');

-- The webhook prune on this node (repo/webhooks.py prune, node by node): delete up to
-- p_limit deliveries of the node's shards delivered or given up more than p_keep_s
-- seconds ago, the oldest of each shard first; returns how many. One local transaction,
-- one phase (a DELETE over every shard through the coordinator commits in two).
CREATE OR REPLACE FUNCTION composer_prune_webhooks_node(p_key TEXT, p_keep_s FLOAT8, p_limit INT)
RETURNS INT
LANGUAGE plpgsql AS $$
DECLARE
    v_shard TEXT;
    v_gone INT := 0;
    v_n INT;
BEGIN
    FOR v_shard IN
        SELECT shard_name('webhook_deliveries'::regclass, s.shardid)
          FROM pg_dist_shard s JOIN pg_dist_placement p ON p.shardid = s.shardid
         WHERE s.logicalrelid = 'webhook_deliveries'::regclass
           AND p.groupid = (SELECT groupid FROM pg_dist_local_group)
         ORDER BY s.shardid
    LOOP
        EXIT WHEN v_gone >= p_limit;
        EXECUTE format($q$
            DELETE FROM %1$s
             WHERE (run_id, id) IN (SELECT run_id, id FROM %1$s
                                     WHERE (delivered_at IS NOT NULL OR gave_up_at IS NOT NULL)
                                       AND COALESCE(delivered_at, gave_up_at) < now() - make_interval(secs => $1)
                                     ORDER BY COALESCE(delivered_at, gave_up_at)
                                     LIMIT $2)$q$, v_shard)
            USING p_keep_s, p_limit - v_gone;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_gone := v_gone + v_n;
    END LOOP;
    RETURN v_gone;
END;
$$;

REVOKE ALL ON FUNCTION composer_prune_webhooks_node(TEXT, FLOAT8, INT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_prune_webhooks_node(TEXT, FLOAT8, INT) TO composer_ops_engine;
SELECT create_distributed_function('composer_prune_webhooks_node(text, float8, int)', 'p_key',
                                   colocate_with => 'workflow_runs');
