-- An event's SQL: its lock and load (composer_load_run) and its one write
-- (composer_apply(doc)). A repeatable file (docs/architecture.md, "where new code goes";
-- the write path).

-- The fenced updates of an event, on its run's month (doc's 'done', 'failed',
-- 'resolved' and 'finish', as composer_apply's header says), as the text of a CREATE FUNCTION p_fn(p_run, p_doc, p_at)
-- on the tables p_runs and p_tasks. One text, two uses (the claim's step 3 does the same,
-- sql/R__claim.sql composer_claim_tasks_source):
--   composer_apply_updates_pYYYYMM on the month's own partitions (composer_apply_month,
--   made with the partitions by composer_ensure_partitions_from, dropped with them):
--   an ordinary table's statements, so PL/pgSQL caches their plans (generic after five
--   calls), and they lock that month's partitions and indexes only;
--   composer_apply_updates on the partitioned tables, for a run ID that is not a UUIDv7,
--   a month without its function, and Citus: a cached generic plan would lock every
--   month before pruning (PostgreSQL 15 to 18), so it is planned at every call with the
--   run ID's value (force_custom_plan) and the planner keeps its month only.
-- Each completion, failure and re-queue is fenced by attempt and in-flight state and
-- writes its history row; a resolved wait moves a WAITING task only; the finish only
-- moves an active run. A miss raises CO409 and rolls the event back.
CREATE OR REPLACE FUNCTION composer_apply_updates_source(p_fn TEXT, p_runs TEXT, p_tasks TEXT, p_options TEXT)
RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $src$
    SELECT format($fn$
CREATE OR REPLACE FUNCTION %1$I(p_run TEXT, p_doc JSONB, p_at TIMESTAMPTZ) RETURNS VOID
LANGUAGE plpgsql
%4$s
AS $body$
DECLARE
    v_done JSONB;
    v_rows INT;
BEGIN
    FOR v_done IN SELECT x.o FROM jsonb_array_elements(p_doc->'done') WITH ORDINALITY AS x(o, i) ORDER BY x.i LOOP
        UPDATE %3$I t
           SET state = 'COMPLETED', output_json = v_done->'output', completed_at = p_at, finished_at = p_at,
               updated_at = p_at, lease_owner = NULL, lease_expires_at = NULL
         WHERE t.run_id = p_run AND t.id = v_done->>'t' AND t.node_id = v_done->>'n'
           AND t.attempt = (v_done->>'a')::int AND t.state IN ('PENDING', 'QUEUED', 'RUNNING');
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows = 0 THEN
            RAISE EXCEPTION 'fenced write matched no row (CompleteTask); the task changed outside the engine, the event was rolled back'
                USING ERRCODE = 'CO409';
        END IF;
        INSERT INTO run_history (run_id, at, kind, node_id, task_id, attempt, worker, request, detail)
        VALUES (p_run, p_at, 'completed', v_done->>'n', v_done->>'t', (v_done->>'a')::int, v_done->>'w',
                p_doc->>'request', v_done->'d');
    END LOOP;
    FOR v_done IN SELECT x.o FROM jsonb_array_elements(p_doc->'failed') WITH ORDINALITY AS x(o, i) ORDER BY x.i LOOP
        IF (v_done->>'r')::boolean THEN      -- re-queued: the next attempt, its dispatch in the outbox
            UPDATE %3$I t
               SET state = 'PENDING', attempt = t.attempt + 1,
                   lease_expiries = t.lease_expiries + COALESCE((v_done->>'x')::int, 0), last_error = v_done->'e',
                   started_at = NULL, updated_at = p_at, lease_owner = NULL, lease_expires_at = NULL
             WHERE t.run_id = p_run AND t.id = v_done->>'t' AND t.node_id = v_done->>'n'
               AND t.attempt = (v_done->>'a')::int AND t.state IN ('PENDING', 'QUEUED', 'RUNNING');
        ELSE
            UPDATE %3$I t
               SET state = 'FAILED', last_error = v_done->'e', finished_at = p_at, updated_at = p_at,
                   lease_owner = NULL, lease_expires_at = NULL
             WHERE t.run_id = p_run AND t.id = v_done->>'t' AND t.node_id = v_done->>'n'
               AND t.attempt = (v_done->>'a')::int AND t.state IN ('PENDING', 'QUEUED', 'RUNNING');
        END IF;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows = 0 THEN
            RAISE EXCEPTION 'fenced write matched no row (%%); the task changed outside the engine, the event was rolled back',
                CASE WHEN (v_done->>'r')::boolean THEN 'RequeueTask' ELSE 'FailTask' END USING ERRCODE = 'CO409';
        END IF;
        INSERT INTO run_history (run_id, at, kind, node_id, task_id, attempt, worker, request, detail)
        VALUES (p_run, p_at, v_done->>'k', v_done->>'n', v_done->>'t', (v_done->>'a')::int, v_done->>'w',
                p_doc->>'request', v_done->'d');
    END LOOP;
    FOR v_done IN SELECT x.o FROM jsonb_array_elements(p_doc->'resolved') WITH ORDINALITY AS x(o, i) ORDER BY x.i LOOP
        UPDATE %3$I t
           SET state = v_done->>'s', output_json = v_done->'output', last_error = v_done->'e',
               finished_at = p_at, updated_at = p_at,
               completed_at = CASE WHEN v_done->>'s' = 'COMPLETED' THEN p_at END
         WHERE t.run_id = p_run AND t.id = v_done->>'t' AND t.state = 'WAITING';
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows = 0 THEN
            RAISE EXCEPTION 'fenced write matched no row (%%); the task changed outside the engine, the event was rolled back',
                v_done->>'f' USING ERRCODE = 'CO409';
        END IF;
    END LOOP;
    IF p_doc ? 'finish' THEN
        UPDATE %2$I r
           SET status = p_doc->'finish'->>'status', error_json = p_doc->'finish'->'error',
               output_json = p_doc->'finish'->'output', completed_at = p_at, updated_at = p_at
         WHERE r.id = p_run AND r.status IN ('PENDING', 'RUNNING');
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows = 0 THEN
            RAISE EXCEPTION 'run %% finished concurrently; the decision was rolled back', p_run USING ERRCODE = 'CO409';
        END IF;
        IF p_doc->'finish' ? 'webhook' THEN
            -- A run finished again (retried) gets a new delivery, under a new ID: the row
            -- of its earlier finish goes first (Citus refuses a new ID in an upsert's SET).
            DELETE FROM webhook_deliveries WHERE run_id = p_run;
            INSERT INTO webhook_deliveries (run_id, url, payload, next_attempt_at, created_at)
            VALUES (p_run, p_doc->'finish'->'webhook'->>'url', p_doc->'finish'->'webhook'->'payload', p_at, p_at);
        END IF;
    END IF;
END;
$body$;
REVOKE ALL ON FUNCTION %1$I(TEXT, JSONB, TIMESTAMPTZ) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION %1$I(TEXT, JSONB, TIMESTAMPTZ) TO composer_ops_engine;
$fn$, p_fn, p_runs, p_tasks, p_options)
$src$;

DO $$
BEGIN
    EXECUTE composer_apply_updates_source('composer_apply_updates', 'workflow_runs', 'task_instances',
                                          'SET plan_cache_mode = force_custom_plan');
END;
$$;

-- The event's first statement (repo/runs.py lock_and_load), as the text of a CREATE
-- FUNCTION p_fn(p_run) on the tables p_runs and p_tasks, with the same two uses as the
-- updates above: composer_load_run_pYYYYMM on the month's own partitions (made and
-- dropped with composer_apply_updates_pYYYYMM by composer_apply_month), cached plans that
-- lock that month only; composer_load_run on the partitioned tables, planned at every call.
-- It takes the run's row lock (a run deleted counts as missing) and returns one row: the
-- database clock (the event's one instant, repo/clock.py), the run's columns, and its
-- tasks but a MAP's items as one JSON array of arrays, in the order repo/runs.py reads
-- them: [node_id, id, state, attempt, branches, signal_name (while WAITING), lease_owner,
-- lease_expires_at, created_at, wake_at, lease_expiries, items_total, items_started,
-- items_done, items_failed]; o_run is NULL when there is no such run. Two statements:
-- in a VOLATILE function each takes its own snapshot, so the tasks are read after the
-- lock is granted and see everything its previous holder committed. (One statement
-- joining both would read them with the snapshot it took before it waited for the
-- lock, and could miss a sibling's completion: the join race the lock exists to prevent.)
CREATE OR REPLACE FUNCTION composer_load_run_source(p_fn TEXT, p_runs TEXT, p_tasks TEXT, p_options TEXT)
RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $src$
    SELECT format($fn$
CREATE OR REPLACE FUNCTION %1$I(p_run TEXT, OUT o_now TIMESTAMPTZ, OUT o_run TEXT, OUT o_workflow TEXT,
                               OUT o_version INT, OUT o_status TEXT, OUT o_parent TEXT, OUT o_parent_node TEXT,
                               OUT o_tasks JSON)
LANGUAGE plpgsql VOLATILE
%4$s
AS $body$
BEGIN
    o_now := now();
    SELECT r.id, r.workflow_definition_id, r.workflow_version, r.status, r.parent_run_id, r.parent_node_id
      INTO o_run, o_workflow, o_version, o_status, o_parent, o_parent_node
      FROM %2$I r
     WHERE r.id = p_run AND r.deleted_at IS NULL
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT json_agg(json_build_array(t.node_id, t.id, t.state, t.attempt, t.branches,
                                     CASE WHEN t.state = 'WAITING' THEN t.signal_name END, t.lease_owner,
                                     t.lease_expires_at, t.created_at, t.wake_at, t.lease_expiries, t.items_total,
                                     t.items_started, t.items_done, t.items_failed))
      INTO o_tasks
      FROM %3$I t
     WHERE t.run_id = p_run AND t.item_index IS NULL;
END;
$body$;
REVOKE ALL ON FUNCTION %1$I(TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION %1$I(TEXT) TO composer_ops_engine;
$fn$, p_fn, p_runs, p_tasks, p_options)
$src$;

DO $$
BEGIN
    EXECUTE composer_load_run_source('composer_load_run', 'workflow_runs', 'task_instances',
                                     'SET plan_cache_mode = force_custom_plan');
END;
$$;

-- Make (p_replace: or make again) composer_apply_updates_p<p_month> and
-- composer_load_run_p<p_month> (YYYYMM) when the month's workflow_runs and
-- task_instances partitions are attached with exactly that month's bounds, and drop them
-- otherwise (a month dropped, detached or misaligned); true when they exist afterwards. Called wherever the claim's function of the month is
-- (composer_claim_month, sql/R__claim.sql: R__partitions.sql, the retention drop, the
-- archive's removal of a month). Not on Citus.
CREATE OR REPLACE FUNCTION composer_apply_month(p_month TEXT, p_replace BOOLEAN DEFAULT false)
RETURNS BOOLEAN
LANGUAGE plpgsql AS $$
DECLARE
    fn TEXT := 'composer_apply_updates_p' || p_month;
    load TEXT := 'composer_load_run_p' || p_month;
BEGIN
    IF p_month IS NULL OR p_month !~ '^\d{6}$' OR EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
        RETURN false;
    END IF;
    IF NOT composer_month_aligned(p_month) THEN
        EXECUTE format('DROP FUNCTION IF EXISTS %I(TEXT, JSONB, TIMESTAMPTZ)', fn);
        EXECUTE format('DROP FUNCTION IF EXISTS %I(TEXT)', load);
        RETURN false;
    END IF;
    IF p_replace OR to_regproc(format('%I', fn)) IS NULL THEN
        EXECUTE composer_apply_updates_source(fn, 'workflow_runs_p' || p_month, 'task_instances_p' || p_month, '');
    END IF;
    IF p_replace OR to_regproc(format('%I', load)) IS NULL THEN
        EXECUTE composer_load_run_source(load, 'workflow_runs_p' || p_month, 'task_instances_p' || p_month, '');
    END IF;
    RETURN true;
END;
$$;
REVOKE ALL ON FUNCTION composer_apply_month(TEXT, BOOLEAN) FROM PUBLIC;

-- composer_apply(doc), the event's one write. The shell (composer_ops/engine/shell.py) turns what a decision writes at its end into
-- one JSON document and sends it as one statement; a start sends nothing else, so with
-- BEGIN and COMMIT pipelined a start is one round trip (composer_ops/engine/starts.py).
-- The document (built by composer_ops/repo/writes.py):
--   at       the instant the decision was made with (the event's clock);
--   run_id, request (the API call: every history row carries it; a start without one, a
--            seed's, writes no 'started' row)
--   start    (a start only) the run to insert: wf, version, deployed (the caller asked
--            for the deployed version), input, context, parent, parent_node, started
--            (the detail of its 'started' history row), max_age_s and max_ahead_s (the
--            run ID's recency window; absent for a derived ID: a child's, a schedule
--            slot's);
--   done     CompleteTask actions: t task, n node, a attempt, output, and the history row's
--            w worker and d detail; fenced (a miss raises CO409, a Conflict);
--   failed   FailTask and RequeueTask actions: t, n, a, w, d as in done, k the history row's
--            kind, e the error document, r true for a re-queue (attempt + 1, back to
--            PENDING; its dispatch is in outbox) and x 1 when a lost lease caused it
--            (one more lease expiry); fenced (a miss raises CO409);
--   resolved ResolveWait, FinishChild and FinishMap: t the WAITING task, s its new state
--            (COMPLETED or FAILED), output, e the error document, f the action's name
--            (for the error); fenced on the task still WAITING (a miss raises CO409);
--   finish   FinishRun: status, error, output and, for a definition with a webhook, webhook
--            {url, payload}; only from an active status (else CO409);
--   tasks    the rows of CreateTask actions (repo/writes.py names the keys);
--   history  the event's history rows, in order;
--   outbox   the dispatches, exactly as composer_enqueue (sql/R__dispatch.sql) reads them.
--
-- The database's clock is the only clock: every instant written is this transaction's
-- now(). An instant the decision computed (a timer's wake_at, a retry's available_at)
-- is moved by (now() - at): it keeps its distance from the event's instant. An event
-- decided under the run lock (repo/runs.py lock_and_load) was decided with now() itself,
-- so nothing moves; a start is decided before its one round trip, with the client's
-- estimate of the database clock, and its timers start from the commit's clock.
--
-- A start is refused, with nothing written, as a status (the caller's transaction stays
-- usable): 'run_id' (not a UUIDv7, or outside the recency window by now()), 'partition'
-- (no partition holds its month), 'definition' (the version is missing, deleted,
-- disabled or, asked for the deployed one, no longer deployed: the caller refreshes its
-- cached definition and tries once more), 'conflict' (the run ID is taken). A task whose
-- (run, node) already has one raises unique_violation, which rolls the event back.
-- Returns {"status": ..., "now": now()}.
CREATE OR REPLACE FUNCTION composer_apply(doc JSONB) RETURNS JSONB
LANGUAGE plpgsql AS $$
DECLARE
    -- exact: 'at' was read in this transaction: it is the clock.
    at_now TIMESTAMPTZ := CASE WHEN (doc->>'exact')::boolean THEN (doc->>'at')::timestamptz ELSE now() END;
    shift INTERVAL := at_now - (doc->>'at')::timestamptz;
    v_run TEXT := doc->>'run_id';
    v_start JSONB := doc->'start';
    v_month TEXT;
    v_minted TIMESTAMPTZ;
    v_def RECORD;
    v_rows INT;
    v_outbox JSONB := doc->'outbox';
    v_task RECORD;
    v_entry JSONB;
    v_branches TEXT[];
BEGIN
    IF v_start IS NOT NULL THEN
        v_month := composer_run_month(v_run);
        IF v_month IS NULL THEN
            RETURN jsonb_build_object('status', 'run_id', 'now', at_now);
        END IF;
        IF v_start ? 'max_age_s' THEN
            v_minted := timestamptz 'epoch'
                        + ('x' || substr(v_run, 1, 8) || substr(v_run, 10, 4))::bit(48)::bigint * interval '1 ms';
            IF v_minted < at_now - make_interval(secs => (v_start->>'max_age_s')::float8)
               OR v_minted > at_now + make_interval(secs => (v_start->>'max_ahead_s')::float8) THEN
                RETURN jsonb_build_object('status', 'run_id', 'now', at_now);
            END IF;
        END IF;
        IF to_regclass('workflow_runs_p' || v_month) IS NULL THEN
            RETURN jsonb_build_object('status', 'partition', 'now', at_now);
        END IF;
        SELECT d.deployed, d.enabled, d.deleted_at INTO v_def
          FROM workflow_definitions d
         WHERE d.id = v_start->>'wf' AND d.version = (v_start->>'version')::int;
        IF NOT FOUND OR v_def.deleted_at IS NOT NULL OR NOT v_def.enabled
           OR ((v_start->>'deployed')::boolean AND NOT v_def.deployed) THEN
            RETURN jsonb_build_object('status', 'definition', 'now', at_now);
        END IF;
        INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, input_json, context_json,
                                   parent_run_id, parent_node_id, created_at, updated_at)
        VALUES (v_run, v_start->>'wf', (v_start->>'version')::int, 'RUNNING', v_start->'input', v_start->'context',
                v_start->>'parent', v_start->>'parent_node', at_now, at_now)
        ON CONFLICT (id) DO NOTHING;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows = 0 THEN
            RETURN jsonb_build_object('status', 'conflict', 'now', at_now);
        END IF;
        IF doc ? 'request' THEN        -- how a retried start recognises its own run
            INSERT INTO run_history (run_id, at, kind, request, detail)
            VALUES (v_run, at_now, 'started', doc->>'request', v_start->'started');
        END IF;
    END IF;

    -- Completions, failures, re-queues, resolved waits and the run's finish, on the run's month partitions
    -- by name (composer_apply_updates_source says why); the dispatch below is a function call,
    -- planned at every call, the updates inside it are not.
    IF doc ? 'done' OR doc ? 'failed' OR doc ? 'resolved' OR doc ? 'finish' THEN
        v_month := COALESCE(v_month, composer_run_month(v_run));
        IF v_month IS NOT NULL AND to_regproc('composer_apply_updates_p' || v_month) IS NOT NULL THEN
            EXECUTE format('SELECT %I($1, $2, $3)', 'composer_apply_updates_p' || v_month) USING v_run, doc, at_now;
        ELSE
            PERFORM composer_apply_updates(v_run, doc, at_now);
        END IF;
    END IF;

    -- One INSERT ... VALUES per row, naming the run: each routed to the run's shard on
    -- Citus (an INSERT ... SELECT from the document is planned through the coordinator
    -- and committed with two-phase commit, docs/scaling.md).
    FOR v_task IN SELECT * FROM jsonb_to_recordset(COALESCE(doc->'tasks', '[]'))
                  AS r(id text, node text, type text, queue text, state text, input jsonb, output jsonb,
                       error jsonb, branches jsonb, wake timestamptz, signal text, total int, started int) LOOP
        v_branches := CASE WHEN v_task.branches IS NOT NULL
                           THEN ARRAY(SELECT jsonb_array_elements_text(v_task.branches)) END;
        INSERT INTO task_instances
               (id, run_id, node_id, node_type, queue, state, input_json, output_json, last_error,
                branches, wake_at, signal_name, items_total, items_started, items_done, items_failed,
                scheduled_at, finished_at, completed_at, created_at, updated_at)
        VALUES (v_task.id, v_run, v_task.node, v_task.type, v_task.queue, v_task.state, v_task.input, v_task.output,
                v_task.error,
                v_branches,
                v_task.wake + shift, v_task.signal, v_task.total, v_task.started,
                CASE WHEN v_task.total IS NOT NULL THEN 0 END, CASE WHEN v_task.total IS NOT NULL THEN 0 END, at_now,
                CASE WHEN v_task.state IN ('COMPLETED', 'FAILED', 'SKIPPED', 'CANCELLED') THEN at_now END,
                CASE WHEN v_task.state = 'COMPLETED' THEN at_now END, at_now, at_now)
        ON CONFLICT (run_id, node_id) WHERE item_index IS NULL DO NOTHING;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows = 0 THEN
            RAISE EXCEPTION 'run %: node % already has a task; the decision was based on a stale snapshot and was rolled back',
                v_run, v_task.node USING ERRCODE = 'unique_violation';
        END IF;
    END LOOP;

    FOR v_entry IN SELECT e.o FROM jsonb_array_elements(COALESCE(doc->'history', '[]')) WITH ORDINALITY AS e(o, i)
                    ORDER BY e.i LOOP
        INSERT INTO run_history (run_id, at, kind, node_id, task_id, attempt, worker, request, detail)
        VALUES (v_run, at_now, v_entry->>'k', v_entry->>'n', v_entry->>'t', (v_entry->>'a')::int4, v_entry->>'w',
                doc->>'request', v_entry->'d');
    END LOOP;

    IF jsonb_array_length(COALESCE(v_outbox, '[]')) > 0 THEN
        IF shift <> interval '0' THEN
            SELECT jsonb_agg(CASE WHEN o ? 'av' THEN o || jsonb_build_object('av', (o->>'av')::timestamptz + shift)
                                  ELSE o END ORDER BY i)
              INTO v_outbox
              FROM jsonb_array_elements(v_outbox) WITH ORDINALITY AS x(o, i);
        END IF;
        PERFORM composer_enqueue(v_outbox, at_now);
    END IF;
    RETURN jsonb_build_object('status', 'ok', 'now', at_now);
END;
$$;

-- The event's one write, by its run: composer_apply(doc) for doc's run p_run. What the
-- engine calls (composer_ops/repo/writes.py). The run ID as an argument of its own is
-- what would let Citus delegate the call to the run's node; it is not delegated
-- (sql/citus/R__apply_on.sql says why).
CREATE OR REPLACE FUNCTION composer_apply_on(p_run TEXT, doc JSONB) RETURNS JSONB
LANGUAGE plpgsql AS $$
BEGIN
    IF p_run IS DISTINCT FROM doc->>'run_id' THEN
        RAISE EXCEPTION 'composer_apply_on: run % does not match the document''s run %', p_run, doc->>'run_id'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN composer_apply(doc);
END;
$$;
