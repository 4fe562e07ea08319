DROP FUNCTION IF EXISTS composer_claim_node(TEXT, TEXT[], TEXT[], TEXT, INT, TEXT);
DROP FUNCTION IF EXISTS composer_claim_node(TEXT, TEXT[], TEXT[], TEXT, INT, TEXT, BOOLEAN);
-- Citus only: the claim, delegated to one worker node (docs/scaling.md, "Dispatch on
-- Citus"). The outbox is distributed by run ID and co-located with the runs
-- (sql/citus/V016), so a node holds the outbox rows of its own runs. A worker calls
-- composer_claim_node(p_key, ...) with a key that hashes to a shard of that node
-- (repo/citus.py, stream keys); Citus delegates the call there (create_distributed_function
-- below), and the claim reads the node's own outbox shards, oldest first within each
-- shard, starting at a shard picked at random: per-shard FIFO, not global. Each task is
-- claimed with its history row by statements routed to the run's shard, on this node:
-- the whole claim is a local transaction of one node, committed in one phase.
-- Called in autocommit (one statement for the caller): a call Citus does not delegate (in
-- a transaction block, say) raises CO421 rather than claim from no shard
-- (sql/citus/R__node_local.sql).
-- A claim ID fenced on this node (claim_node_fences, sql/citus/V017) claims nothing here,
-- unless p_retry: the call of a retried claim, which first fences its ID on the node, in
-- this transaction, under the claim's lock (so an attempt of it still running here is
-- waited for, and one arriving later claims nothing), and then claims up to p_limit
-- (0: only the lock and the fence; the engine's retry looks for what the lost attempt
-- took once every node is fenced, engine/engine.py).
CREATE OR REPLACE FUNCTION composer_claim_node(p_key TEXT, p_queues TEXT[], p_names TEXT[], p_owner TEXT,
                                               p_limit INT, p_claim TEXT, p_retry BOOLEAN)
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ, limited BOOLEAN)
LANGUAGE plpgsql
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now TIMESTAMPTZ := now();
    v_shard TEXT;
    v_got INT := 0;
    o RECORD;
    v_node TEXT;
    v_input JSONB;
    v_lease INT;
    v_open TEXT[];
    v_limited BOOLEAN := false;
    v_shards TEXT[] := '{}';
BEGIN
    IF NOT composer_key_on_this_node(p_key) THEN     -- not delegated (sql/citus/R__node_local.sql)
        PERFORM composer_not_delegated('composer_claim_node', p_key);
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('composer_claim'), hashtext(p_claim));
    IF p_retry THEN
        DELETE FROM claim_node_fences f WHERE f.key = p_key AND f.at < now() - interval '1 day';
        INSERT INTO claim_node_fences (key, claim) VALUES (p_key, p_claim) ON CONFLICT (key, claim) DO NOTHING;
    ELSIF EXISTS (SELECT 1 FROM claim_node_fences f WHERE f.key = p_key AND f.claim = p_claim) THEN
        RETURN;
    END IF;
    -- The queues this claim takes from: not paused, without a limit (queue_settings is a
    -- reference table, read here). A limited queue's rows, and rows with a concurrency
    -- key or a rate limit, are the coordinator's claim's (repo/citus.py): when this node
    -- has such rows ready, the last row returned says so (limited, run_id NULL).
    SELECT array_agg(DISTINCT w.q) FILTER (WHERE s.queue IS NULL OR (NOT s.paused AND s.max_running = 0)),
           COALESCE(bool_or(NOT s.paused AND s.max_running > 0), false)
      INTO v_open, v_limited
      FROM unnest(p_queues) AS w(q) LEFT JOIN queue_settings s ON s.queue = w.q;
    FOR v_shard IN
        SELECT shard_name('task_outbox'::regclass, s.shardid)
          FROM pg_dist_shard s JOIN pg_dist_placement p ON p.shardid = s.shardid
         WHERE s.logicalrelid = 'task_outbox'::regclass AND p.groupid = (SELECT groupid FROM pg_dist_local_group)
         ORDER BY random()
    LOOP
        EXIT WHEN v_got >= p_limit;
        v_shards := v_shards || v_shard;
        CONTINUE WHEN v_open IS NULL;
        -- The rows are picked in a MATERIALIZED CTE, run once. Picked in an IN (subquery),
        -- a nested-loop semi join (the plan of a shard analyzed while empty) ran the
        -- subquery again for every outbox row, and each run skipped the rows this
        -- statement had deleted and locked the next: LIMIT 1 deleted every ready row.
        -- Each queue is read on its own (LATERAL, its queue fixed), in the order of the
        -- shard's idx_task_outbox_ready: a claim reads the rows it locks, whatever the
        -- shard's backlog (over queue = ANY(...) the index's order does not serve, and
        -- every ready row of the shard was read and sorted; so does a bitmap scan, which
        -- a shard without statistics got: off for this function). Of a claim of several
        -- queues, the rows a queue locked beyond the first $4 of all stay locked to the
        -- claim's end (one short transaction of this node): a claim of the same shard
        -- meanwhile skips them, and may come back short of rows that are ready.
        FOR o IN EXECUTE format($q$
            WITH picked AS MATERIALIZED (
                 SELECT c.run_id, c.id
                   FROM unnest($1::text[]) AS w(q),
                        LATERAL (SELECT y.run_id, y.id, y.priority, y.available_at FROM %1$s y
                                  WHERE y.queue = w.q AND y.available_at <= $2
                                    AND ($3::text[] IS NULL OR y.task_name = ANY($3))
                                    AND y.ckey IS NULL AND y.rkey IS NULL
                                  ORDER BY y.priority DESC, y.available_at, y.id
                                  LIMIT $4
                                    FOR UPDATE SKIP LOCKED) AS c
                  ORDER BY c.priority DESC, c.available_at, c.id
                  LIMIT $4)
            DELETE FROM %1$s x USING picked p
             WHERE x.run_id = p.run_id AND x.id = p.id
            RETURNING x.run_id, x.task_id, x.attempt, x.task_name, x.queue, x.lease_s, x.max_run_s$q$, v_shard)
            USING v_open, v_now, p_names, p_limit - v_got
        LOOP
            v_lease := LEAST(o.lease_s, o.max_run_s);
            UPDATE task_instances t
               SET state = 'RUNNING', lease_owner = p_owner, lease_expires_at = v_now + make_interval(secs => v_lease),
                   run_deadline_at = v_now + make_interval(secs => o.max_run_s), started_at = v_now, updated_at = v_now
             WHERE t.run_id = o.run_id AND t.id = o.task_id AND t.attempt = o.attempt AND t.state IN ('PENDING', 'QUEUED')
               AND NOT EXISTS (SELECT 1 FROM workflow_runs r WHERE r.id = o.run_id AND r.deleted_at IS NOT NULL)
            RETURNING t.node_id, t.input_json INTO v_node, v_input;
            CONTINUE WHEN NOT FOUND;
            INSERT INTO run_history (run_id, at, kind, node_id, task_id, attempt, worker, request, detail)
            VALUES (o.run_id, v_now, 'claimed', v_node, o.task_id, o.attempt, p_owner, p_claim,
                    jsonb_build_object('task', o.task_name, 'lease_s', v_lease));
            run_id := o.run_id; task_id := o.task_id; node_id := v_node; attempt := o.attempt;
            task_name := o.task_name; queue := o.queue; input := v_input; lease_s := v_lease;
            lease_owner := p_owner; lease_expires_at := v_now + make_interval(secs => v_lease); limited := false;
            v_got := v_got + 1;
            RETURN NEXT;
        END LOOP;
    END LOOP;
    -- Rows of this node that only the coordinator's claim takes, looked for only when
    -- this node fell short of p_limit: the engine reads the flag only then (it asks the
    -- coordinator's claim for what the nodes did not give). Each shard's look is a
    -- statement planned on every call, a fifth to a third of a one-task claim's CPU
    -- on a node of 16 shards (docs/scaling.md, "Where a run's CPU goes").
    IF v_got < p_limit AND NOT v_limited AND v_open IS NOT NULL THEN
        FOREACH v_shard IN ARRAY v_shards LOOP
            EXECUTE format($q$SELECT EXISTS (SELECT 1 FROM %1$s y
                                WHERE y.queue = ANY($1) AND y.available_at <= $2
                                  AND ($3::text[] IS NULL OR y.task_name = ANY($3))
                                  AND (y.ckey IS NOT NULL OR y.rkey IS NOT NULL))$q$, v_shard)
                INTO v_limited USING v_open, v_now, p_names;
            EXIT WHEN v_limited;
        END LOOP;
    END IF;
    IF v_limited THEN
        run_id := NULL; task_id := NULL; node_id := NULL; attempt := NULL; task_name := NULL; queue := NULL;
        input := NULL; lease_s := NULL; lease_owner := NULL; lease_expires_at := NULL; limited := true;
        RETURN NEXT;
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION composer_claim_node(TEXT, TEXT[], TEXT[], TEXT, INT, TEXT, BOOLEAN) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim_node(TEXT, TEXT[], TEXT[], TEXT, INT, TEXT, BOOLEAN) TO composer_ops_engine;
SELECT create_distributed_function('composer_claim_node(text, text[], text[], text, int, text, boolean)', 'p_key',
                                   colocate_with => 'workflow_runs');
