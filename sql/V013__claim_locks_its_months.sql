-- V013: the claim plans and locks only the months of the tasks it claims.
--
-- Written as one SQL statement (DELETE the outbox rows, then UPDATE task_instances
-- ... FROM them), the claim's task update has no constant run ID: the planner keeps
-- every partition of task_instances, and each call opens and locks all of them with
-- their indexes, 6 relations per monthly partition (39 relation locks with 1 month of
-- history retained, 177 with 24, measured by bench/months.py on PostgreSQL 15). Here
-- the same steps run in one function, one statement for the caller and one
-- transaction: the outbox rows are taken first, then the tasks are updated with their
-- run IDs as a constant array. plan_cache_mode = force_custom_plan makes that update
-- planned with the array's value, so the planner keeps only the partitions the run
-- IDs fall in; a generic (cached) plan would keep them all and lock them before pruning
-- (PostgreSQL 15 to 18). A task of a soft-deleted run is not claimed (its outbox row
-- is consumed all the same); that check names the run IDs as constants too, so it
-- prunes workflow_runs the same way. The run-history row of each claimed task (marked
-- with the claim's ID, which a retried claim looks up) is written by the update's
-- statement.
CREATE OR REPLACE FUNCTION composer_claim(p_queues TEXT[], p_names TEXT[], p_owner TEXT, p_limit INT,
                                          p_claim TEXT)
RETURNS TABLE(run_id TEXT, task_id TEXT, node_id TEXT, attempt INT, task_name TEXT, queue TEXT,
              input JSONB, lease_s INT, lease_owner TEXT, lease_expires_at TIMESTAMPTZ)
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
DECLARE
    runs TEXT[];
    ids TEXT[];
    attempts INT[];
    names TEXT[];
    leases INT[];
    queues TEXT[];
BEGIN
    WITH picked AS (
        DELETE FROM task_outbox o
         USING (SELECT id FROM task_outbox
                 WHERE queue = ANY(p_queues) AND available_at <= NOW()
                   AND (p_names IS NULL OR task_name = ANY(p_names))
                 ORDER BY available_at, id
                 LIMIT p_limit
                   FOR UPDATE SKIP LOCKED) s
         WHERE o.id = s.id
        RETURNING o.run_id, o.task_id, o.attempt, o.task_name, o.lease_s, o.queue)
    SELECT array_agg(picked.run_id), array_agg(picked.task_id), array_agg(picked.attempt),
           array_agg(picked.task_name), array_agg(picked.lease_s), array_agg(picked.queue)
      INTO runs, ids, attempts, names, leases, queues
      FROM picked;
    IF runs IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
        WITH claimed AS (
            UPDATE task_instances t
               SET state = 'RUNNING', lease_owner = p_owner,
                   lease_expires_at = NOW() + make_interval(secs => p.lease_s),
                   started_at = NOW(), updated_at = NOW()
              FROM unnest(runs, ids, attempts, names, leases, queues)
                   AS p(run_id, task_id, attempt, task_name, lease_s, queue)
             WHERE t.run_id = ANY(runs)
               AND t.run_id = p.run_id AND t.id = p.task_id AND t.attempt = p.attempt
               AND t.state IN ('PENDING', 'QUEUED')
               AND NOT EXISTS (SELECT 1 FROM workflow_runs r
                                WHERE r.id = ANY(runs) AND r.id = t.run_id AND r.deleted_at IS NOT NULL)
            RETURNING t.run_id, t.id AS task_id, t.node_id, t.attempt, p.task_name, p.queue,
                      t.input_json AS input, p.lease_s, t.lease_owner, t.lease_expires_at
        ), noted AS (
            INSERT INTO run_history (run_id, kind, node_id, task_id, attempt, worker, request, detail)
            SELECT c.run_id, 'claimed', c.node_id, c.task_id, c.attempt, c.lease_owner, p_claim,
                   jsonb_build_object('task', c.task_name, 'lease_s', c.lease_s)
              FROM claimed c)
        SELECT c.run_id, c.task_id, c.node_id, c.attempt, c.task_name, c.queue, c.input, c.lease_s,
               c.lease_owner, c.lease_expires_at
          FROM claimed c;
END;
$$;

REVOKE ALL ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION composer_claim(TEXT[], TEXT[], TEXT, INT, TEXT) TO composer_ops_engine;
