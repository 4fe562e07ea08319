-- The signatures of earlier versions (no p_ceiling; no p_skip_children, no child and
-- webhook kinds), in databases migrated with them. A coordinator of such a version calls
-- a function that is gone: its node scans fail as errors of the call, and its passes
-- scan every shard through the coordinator (docs/scaling.md).
DROP FUNCTION IF EXISTS composer_scan_node(TEXT, TIMESTAMPTZ, TEXT, INT, TEXT[], TEXT[], TEXT[], TEXT[]);
DROP FUNCTION IF EXISTS composer_scan_node(TEXT, TIMESTAMPTZ, TEXT, TEXT, INT, TEXT[], TEXT[], TEXT[], TEXT[]);
-- Citus only: the coordinator's scans and its webhook prune, one delegated call per worker
-- node (docs/scaling.md, "The coordinator's pass on Citus"). The coordinator calls each
-- function with a key that hashes to a shard of the node (repo/citus.py, stream keys);
-- Citus delegates the call there (create_distributed_function below), and the function
-- reads or deletes in that node's own shards only, by their shard names: a plain local
-- transaction of one node, committed in one phase, with no connection to any other node.
-- Called in autocommit: a call Citus does not delegate (in a transaction block, the
-- node's metadata not synced) raises CO421 rather than read no shard
-- (sql/citus/R__node_local.sql).

-- The candidates of the coordinator's timers, lease sweeper, start timeouts, children
-- loop and webhook relay on this node (composer_ops/repo/citus_scan.py): each kind in
-- p_kinds ('timer', 'lease', 'start', 'child', 'webhook'), up to p_limit rows of it from
-- each shard (the coordinator merges the nodes' rows and keeps the first of each kind),
-- in the order of the single server's statement (repo/signals.py due_waits,
-- repo/tasks.py expired_leases, repo/outbox.py unstarted, repo/deliveries.py pending,
-- repo/webhooks.py due), with the same predicates: p_now is the coordinator's clock
-- (the relay's own read compares with its transaction's NOW()), p_floor the active
-- floor (compared as text, as there: a run ID that is not a UUIDv7 is seen as the
-- single server sees it), the p_skip_* arrays the keys the coordinator is backing off.
-- The rows are hints, each checked again where it is handled: a timer, lease or start
-- under its run's lock, a child row in its target's transaction, a webhook delivery by
-- the update that takes it only if it is still due (repo/webhooks.py take). p_ceiling
-- (NULL: none) is the active ceiling, the greatest run ID with an active task or the end
-- of the month a start may still use (core/runids.py active_ceiling): with the floor it
-- keeps the planner to the months in between; the months ahead, empty, cost planning
-- time on every shard otherwise. One statement per shard and kind, through its partial
-- index (the child rows, a queue, have none, as on a single server); JIT off (a
-- statement over a shard's months is costed above its threshold). Each is a prepared
-- statement of the session (the coordinator reaches the node over its cached
-- connection, V013, so that is a long-lived backend), planned once with a generic plan
-- (the floor prunes the older months when the plan starts): planning each shard's
-- statement at every call made a pass's cost grow with the shards (docs/scaling.md,
-- "The coordinator's pass on Citus"). A statement is named by its kind and the md5 of
-- its text, shard names included, so a shard renamed or of another ID, or a new version
-- of this file, gets a statement of its own; a shard table dropped and made again under
-- its name (a shard moved away and back) is found again by PostgreSQL, which analyses a
-- prepared statement afresh after DDL on what it reads. Each call deallocates the
-- session's statements of shards no longer on this node: a session keeps at most five
-- per shard of its node (one per kind).
CREATE OR REPLACE FUNCTION composer_scan_node(p_key TEXT, p_now TIMESTAMPTZ, p_floor TEXT, p_ceiling TEXT,
                                              p_limit INT, p_kinds TEXT[], p_skip_timers TEXT[],
                                              p_skip_leases TEXT[], p_skip_starts TEXT[],
                                              p_skip_children TEXT[])
RETURNS TABLE(kind TEXT, run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, lease_owner TEXT,
              timed_out BOOLEAN, at TIMESTAMPTZ, target_run_id TEXT, delivery_id BIGINT)
LANGUAGE plpgsql
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    s RECORD;
    v_kind TEXT;
    v_sql TEXT;
    v_name TEXT;
    v_names TEXT[] := '{}';
    v_have TEXT[];
BEGIN
    IF NOT composer_key_on_this_node(p_key) THEN     -- not delegated (sql/citus/R__node_local.sql)
        PERFORM composer_not_delegated('composer_scan_node', p_key);
    END IF;
    v_have := ARRAY(SELECT name FROM pg_prepared_statements WHERE name LIKE 'composer\_scan\_%');
    FOR s IN
        SELECT shard_name('workflow_runs'::regclass, r.shardid) AS runs,
               shard_name('task_instances'::regclass, t.shardid) AS tasks,
               shard_name('task_outbox'::regclass, o.shardid) AS outbox,
               shard_name('child_deliveries'::regclass, c.shardid) AS children,
               shard_name('webhook_deliveries'::regclass, w.shardid) AS webhooks
          FROM pg_dist_shard r
          JOIN pg_dist_shard t ON t.logicalrelid = 'task_instances'::regclass AND t.shardminvalue = r.shardminvalue
          JOIN pg_dist_shard o ON o.logicalrelid = 'task_outbox'::regclass AND o.shardminvalue = r.shardminvalue
          JOIN pg_dist_shard c ON c.logicalrelid = 'child_deliveries'::regclass AND c.shardminvalue = r.shardminvalue
          JOIN pg_dist_shard w ON w.logicalrelid = 'webhook_deliveries'::regclass AND w.shardminvalue = r.shardminvalue
          JOIN pg_dist_placement p ON p.shardid = r.shardid
         WHERE r.logicalrelid = 'workflow_runs'::regclass AND p.groupid = (SELECT groupid FROM pg_dist_local_group)
    LOOP
        FOREACH v_kind IN ARRAY ARRAY['timer', 'lease', 'start', 'child', 'webhook'] LOOP
            v_sql := format(CASE v_kind
                WHEN 'timer' THEN $q$
                SELECT 'timer'::text, t.run_id, t.id, t.node_id, NULL::int, NULL::text, NULL::boolean, t.wake_at,
                       NULL::text, NULL::bigint
                  FROM %1$s t JOIN %2$s r ON r.id = t.run_id
                 WHERE t.state = 'WAITING' AND t.wake_at <= $1 AND t.id <> ALL($2)
                   AND t.run_id >= $3 AND r.id >= $3 AND ($5::text IS NULL OR (t.run_id <= $5 AND r.id <= $5))
                   AND r.deleted_at IS NULL AND r.status IN ('PENDING', 'RUNNING')
                 ORDER BY t.wake_at LIMIT $4$q$
                WHEN 'lease' THEN $q$
                SELECT 'lease'::text, t.run_id, t.id, t.node_id, t.attempt, t.lease_owner,
                       COALESCE(t.lease_expires_at >= t.run_deadline_at, false), t.lease_expires_at,
                       NULL::text, NULL::bigint
                  FROM %1$s t JOIN %2$s r ON r.id = t.run_id
                 WHERE t.state = 'RUNNING' AND t.lease_expires_at <= $1
                   AND t.id || ':' || t.attempt <> ALL($2)
                   AND t.run_id >= $3 AND r.id >= $3 AND ($5::text IS NULL OR (t.run_id <= $5 AND r.id <= $5))
                   AND r.deleted_at IS NULL AND r.status IN ('PENDING', 'RUNNING')
                 ORDER BY t.lease_expires_at LIMIT $4$q$
                WHEN 'start' THEN $q$
                SELECT 'start'::text, o.run_id, o.task_id, NULL::text, o.attempt, NULL::text, NULL::boolean, o.start_by,
                       NULL::text, NULL::bigint
                  FROM %3$s o
                 WHERE o.start_by <= $1 AND o.task_id || ':' || o.attempt <> ALL($2)
                 ORDER BY o.start_by LIMIT $4$q$
                WHEN 'child' THEN $q$
                SELECT 'child'::text, c.run_id, NULL::text, NULL::text, NULL::int, NULL::text, NULL::boolean,
                       c.written_at, c.target_run_id, NULL::bigint
                  FROM %4$s c
                 WHERE c.run_id || ' ' || c.target_run_id <> ALL($2)
                 ORDER BY c.written_at LIMIT $4$q$
                ELSE $q$
                SELECT 'webhook'::text, w.run_id, NULL::text, NULL::text, NULL::int, NULL::text, NULL::boolean,
                       w.next_attempt_at, NULL::text, w.id
                  FROM %5$s w
                 WHERE w.delivered_at IS NULL AND w.gave_up_at IS NULL AND w.next_attempt_at <= $1
                 ORDER BY w.next_attempt_at LIMIT $4$q$ END,
                s.tasks, s.runs, s.outbox, s.children, s.webhooks);
            v_name := format('composer_scan_%s_%s', v_kind, md5(v_sql));
            v_names := v_names || v_name;
            CONTINUE WHEN NOT v_kind = ANY(p_kinds);
            IF NOT v_name = ANY(v_have) THEN
                EXECUTE format('PREPARE %I(timestamptz, text[], text, int, text) AS %s', v_name, v_sql);
            END IF;
            RETURN QUERY EXECUTE format('EXECUTE %I(%L, %L, %L, %L, %L)', v_name, p_now,
                CASE v_kind WHEN 'timer' THEN p_skip_timers WHEN 'lease' THEN p_skip_leases
                            WHEN 'start' THEN p_skip_starts WHEN 'child' THEN p_skip_children
                            ELSE '{}'::text[] END,
                p_floor, p_limit, p_ceiling);
        END LOOP;
    END LOOP;
    -- Statements of shards no longer on this node (moved, dropped): deallocated.
    FOREACH v_name IN ARRAY v_have LOOP
        IF NOT v_name = ANY(v_names) THEN
            EXECUTE format('DEALLOCATE %I', v_name);
        END IF;
    END LOOP;
END;
$$;

REVOKE ALL ON FUNCTION composer_scan_node(TEXT, TIMESTAMPTZ, TEXT, TEXT, INT, TEXT[], TEXT[], TEXT[], TEXT[],
                                          TEXT[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_scan_node(TEXT, TIMESTAMPTZ, TEXT, TEXT, INT, TEXT[], TEXT[], TEXT[], TEXT[],
                                             TEXT[]) TO composer_ops_engine;
SELECT create_distributed_function(
    'composer_scan_node(text, timestamptz, text, text, int, text[], text[], text[], text[], text[])', 'p_key',
    colocate_with => 'workflow_runs');

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
    IF NOT composer_key_on_this_node(p_key) THEN
        PERFORM composer_not_delegated('composer_prune_webhooks_node', p_key);
    END IF;
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
