DROP FUNCTION IF EXISTS composer_claim_node(TEXT, TEXT[], TEXT[], TEXT, INT, TEXT);
DROP FUNCTION IF EXISTS composer_claim_node(TEXT, TEXT[], TEXT[], TEXT, INT, TEXT, BOOLEAN);
-- Runs p_execute, an EXECUTE of a prepared statement of the session, with the
-- statement's generic plan: planned once per session, not at every call. A function of
-- its own, so that only these statements are planned so: Citus cannot make a generic
-- plan of composer_claim_node's statements on distributed tables ("could not create
-- distributed plan"), and plan_cache_mode is read when a statement is executed.
CREATE OR REPLACE FUNCTION composer_execute_generic(p_execute TEXT) RETURNS SETOF RECORD
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN QUERY EXECUTE p_execute;
END;
$$;

REVOKE ALL ON FUNCTION composer_execute_generic(TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_execute_generic(TEXT) TO composer_ops_engine;

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
-- The per-shard statements (the pick-and-delete, the look for limited rows) are
-- prepared statements of the session, as the node scan's (sql/citus/R__scan_node.sql):
-- the coordinator reaches the node over its cached connection (V013), a long-lived
-- backend, so each is planned once, with a generic plan (composer_execute_generic
-- above), rather than at every claim (EXECUTE of a text is planned on every call). A
-- statement is named by its kind and the md5 of its text, shard name included: a shard
-- of another ID, or a new version of this file, gets a statement of its own; a shard
-- table dropped and made again under its name (moved away and back) is found again by
-- PostgreSQL, which analyses a prepared statement afresh after DDL on what it reads. Each call deallocates the
-- session's statements of shards no longer on this node: at most two per shard.
CREATE OR REPLACE FUNCTION composer_claim_node(p_key TEXT, p_queues TEXT[], p_names TEXT[], p_owner TEXT,
                                               p_limit INT, p_claim TEXT, p_retry BOOLEAN)
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ, limited BOOLEAN)
LANGUAGE plpgsql AS $$
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
    v_shards TEXT[];
    v_n INT;
    v_picks TEXT[] := '{}';
    v_looks TEXT[] := '{}';
    v_look_sql TEXT[] := '{}';
    v_sql TEXT;
    v_name TEXT;
    v_have TEXT[];
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
    SELECT array_agg(w.q) FILTER (WHERE s.queue IS NULL OR (NOT s.paused AND s.max_running = 0)),
           COALESCE(bool_or(NOT s.paused AND s.max_running > 0), false)
      INTO v_open, v_limited
      FROM unnest(p_queues) AS w(q) LEFT JOIN queue_settings s ON s.queue = w.q;
    -- This node's outbox shards, in random order, each with the names of its two
    -- statements; the statements of the session not among them are deallocated.
    v_shards := ARRAY(
        SELECT shard_name('task_outbox'::regclass, s.shardid)
          FROM pg_dist_shard s JOIN pg_dist_placement p ON p.shardid = s.shardid
         WHERE s.logicalrelid = 'task_outbox'::regclass AND p.groupid = (SELECT groupid FROM pg_dist_local_group)
         ORDER BY random());
    v_have := ARRAY(SELECT name FROM pg_prepared_statements WHERE name LIKE 'composer\_claim\_%');
    FOREACH v_shard IN ARRAY v_shards LOOP
        -- The rows are picked in a MATERIALIZED CTE, run once. Picked in an IN (subquery),
        -- a nested-loop semi join (the plan of a shard analyzed while empty) ran the
        -- subquery again for every outbox row, and each run skipped the rows this
        -- statement had deleted and locked the next: LIMIT 1 deleted every ready row.
        v_sql := format($q$
            WITH picked AS MATERIALIZED (
                 SELECT y.run_id, y.id FROM %1$s y
                  WHERE y.queue = ANY($1) AND y.available_at <= $2 AND ($3::text[] IS NULL OR y.task_name = ANY($3))
                    AND y.ckey IS NULL AND y.rkey IS NULL
                  ORDER BY y.priority DESC, y.available_at, y.id
                  LIMIT $4
                    FOR UPDATE SKIP LOCKED)
            DELETE FROM %1$s x USING picked p
             WHERE x.run_id = p.run_id AND x.id = p.id
            RETURNING x.run_id, x.task_id, x.attempt, x.task_name, x.queue, x.lease_s, x.max_run_s$q$, v_shard);
        v_picks := v_picks || format('composer_claim_pick_%s', md5(v_sql));
        IF NOT v_picks[cardinality(v_picks)] = ANY(v_have) THEN
            EXECUTE format('PREPARE %I(text[], timestamptz, text[], int) AS %s', v_picks[cardinality(v_picks)], v_sql);
        END IF;
        -- Rows of this node that only the coordinator's claim takes.
        v_sql := format($q$SELECT EXISTS (SELECT 1 FROM %1$s y
                            WHERE y.queue = ANY($1) AND y.available_at <= $2
                              AND ($3::text[] IS NULL OR y.task_name = ANY($3))
                              AND (y.ckey IS NOT NULL OR y.rkey IS NOT NULL))$q$, v_shard);
        v_look_sql := v_look_sql || v_sql;
        v_looks := v_looks || format('composer_claim_look_%s', md5(v_sql));
    END LOOP;
    FOREACH v_name IN ARRAY v_have LOOP
        IF NOT (v_name = ANY(v_picks) OR v_name = ANY(v_looks)) THEN
            EXECUTE format('DEALLOCATE %I', v_name);
        END IF;
    END LOOP;
    FOREACH v_name IN ARRAY v_picks LOOP
        EXIT WHEN v_got >= p_limit OR v_open IS NULL;
        FOR o IN SELECT * FROM composer_execute_generic(
                     format('EXECUTE %I(%L, %L, %L, %L)', v_name, v_open, v_now, p_names, p_limit - v_got))
                     AS x(run_id TEXT, task_id TEXT, attempt INT, task_name TEXT, queue TEXT, lease_s INT, max_run_s INT)
        LOOP
            v_lease := LEAST(o.lease_s, o.max_run_s);
            EXECUTE format($q$
                WITH claimed AS (
                    UPDATE %1$s t
                       SET state = 'RUNNING', lease_owner = $1, lease_expires_at = $2 + make_interval(secs => $3),
                           run_deadline_at = $2 + make_interval(secs => $4), started_at = $2, updated_at = $2
                     WHERE t.run_id = $5 AND t.id = $6 AND t.attempt = $7 AND t.state IN ('PENDING', 'QUEUED')
                       AND NOT EXISTS (SELECT 1 FROM %2$s r WHERE r.id = $5 AND r.deleted_at IS NOT NULL)
                    RETURNING t.node_id, t.input_json),
                history AS (
                    INSERT INTO %3$s (run_id, seq, at, kind, node_id, task_id, attempt, worker, request, detail)
                    SELECT $5, nextval('run_history_seq'), $2, 'claimed', c.node_id, $6, $7, $1, $8,
                           jsonb_build_object('task', $9::text, 'lease_s', $3)
                      FROM claimed c)
                SELECT c.node_id, c.input_json FROM claimed c$q$,
                shard_name('task_instances'::regclass, get_shard_id_for_distribution_column('task_instances', o.run_id)),
                shard_name('workflow_runs'::regclass, get_shard_id_for_distribution_column('workflow_runs', o.run_id)),
                shard_name('run_history'::regclass, get_shard_id_for_distribution_column('run_history', o.run_id)))
                INTO v_node, v_input
                USING p_owner, v_now, v_lease, o.max_run_s, o.run_id, o.task_id, o.attempt, p_claim, o.task_name;
            GET DIAGNOSTICS v_n = ROW_COUNT;
            CONTINUE WHEN v_n = 0;
            run_id := o.run_id; task_id := o.task_id; node_id := v_node; attempt := o.attempt;
            task_name := o.task_name; queue := o.queue; input := v_input; lease_s := v_lease;
            lease_owner := p_owner; lease_expires_at := v_now + make_interval(secs => v_lease); limited := false;
            v_got := v_got + 1;
            RETURN NEXT;
        END LOOP;
    END LOOP;
    -- Rows of this node that only the coordinator's claim takes, looked for only when
    -- this node fell short of p_limit (so after reading every shard): the engine reads
    -- the flag only then (it asks the coordinator's claim for what the nodes did not give).
    IF v_got < p_limit AND NOT v_limited AND v_open IS NOT NULL THEN
        FOR j IN 1 .. cardinality(v_looks) LOOP
            IF NOT v_looks[j] = ANY(v_have) THEN
                EXECUTE format('PREPARE %I(text[], timestamptz, text[]) AS %s', v_looks[j], v_look_sql[j]);
            END IF;
            SELECT x.found INTO v_limited
              FROM composer_execute_generic(format('EXECUTE %I(%L, %L, %L)', v_looks[j], v_open, v_now, p_names))
                   AS x(found BOOLEAN);
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
