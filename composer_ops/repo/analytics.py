"""Read-only statements behind the operations analytics (:mod:`composer_ops.ops`).

Each function returns plain row tuples in the column order its docstring names. Task
queries write the active states or ``state = 'RUNNING'`` as literals, the predicates of
the partial indexes on ``task_instances``, so their cost follows the live work, not the
history; run-scoped queries filter on the run ID (one partition). Ages use the database
clock read once per query (:mod:`composer_ops.repo.clock`), so they agree across Citus
shards.
"""

from __future__ import annotations

from typing import Any

from composer_ops.core.model import ACTIVE_TASK_STATES
from composer_ops.repo import clock
from composer_ops.repo._base import Conn, sql_states

Row = tuple[Any, ...]

#: The active task states as an SQL list literal: the partial index predicate.
ACTIVE_SQL = sql_states(ACTIVE_TASK_STATES)
#: What queue a non-TASK node (SWITCH, WAIT, WAIT_FOR_SIGNAL) is listed under.
COORDINATOR_QUEUE = "(coordinator)"


def _seconds_until(column: str) -> str:
    """SQL for the seconds from the database clock to ``column``, +/-Infinity when the
    column holds 'infinity' or '-infinity' (odd data a hand edit leaves; PostgreSQL 15
    refuses to subtract an infinite timestamp), NULL when it is NULL."""
    return (f"CASE WHEN isfinite({column}) THEN extract(epoch FROM {column} - %(now)s::timestamptz)::float8 "
            f"WHEN {column} > %(now)s::timestamptz THEN 'Infinity'::float8 "
            f"WHEN {column} < %(now)s::timestamptz THEN '-Infinity'::float8 END")


def _rows(conn: Conn, query: str, params: dict[str, Any] | None = None) -> list[Row]:
    """Run ``query`` with ``params`` and ``now``, the database clock."""
    with conn.cursor() as cur:
        cur.execute(query.encode(), {**(params or {}), "now": clock.now(conn)})
        return cur.fetchall()


def db_now(conn: Conn) -> Any:
    """``now()`` of the current transaction (the database clock)."""
    return clock.now(conn)


# -- active tasks ------------------------------------------------------------------

ACTIVE_TASKS_SQL = f"""
    SELECT t.run_id, t.id, t.node_id, t.node_type, COALESCE(t.queue, '{COORDINATOR_QUEUE}') AS queue,
           t.state, t.attempt, t.created_at, t.updated_at, t.wake_at, t.signal_name,
           extract(epoch FROM %(now)s::timestamptz - t.created_at)::float8 AS age_s
      FROM task_instances t
     WHERE t.state IN {ACTIVE_SQL}
     ORDER BY t.created_at, t.run_id, t.node_id
     LIMIT %(limit)s
"""

ACTIVE_BY_GROUP_SQL = f"""
    WITH a AS MATERIALIZED (
        SELECT state, COALESCE(queue, '{COORDINATOR_QUEUE}') AS queue, node_type, created_at, run_id, node_id
          FROM task_instances
         WHERE state IN {ACTIVE_SQL})
    SELECT g.state, g.queue, g.node_type, g.tasks, o.created_at,
           extract(epoch FROM %(now)s::timestamptz - o.created_at)::float8, o.run_id, o.node_id
      FROM (SELECT state, queue, node_type, count(*) AS tasks FROM a GROUP BY state, queue, node_type) g
      JOIN (SELECT DISTINCT ON (state, queue, node_type) state, queue, node_type, created_at, run_id, node_id
              FROM a ORDER BY state, queue, node_type, created_at, run_id, node_id) o
        USING (state, queue, node_type)
     ORDER BY g.state, g.queue, g.node_type
"""

AGE_HISTOGRAM_SQL = f"""
    SELECT width_bucket(extract(epoch FROM %(now)s::timestamptz - created_at)::float8, %(bounds)s::float8[]) AS bucket,
           state, count(*) AS tasks
      FROM task_instances
     WHERE state IN {ACTIVE_SQL}
     GROUP BY 1, 2
"""

ACTIVE_RUN_COUNT_SQL = f"""
    SELECT count(DISTINCT run_id) FROM task_instances WHERE state IN {ACTIVE_SQL}
"""

TOP_RUNS_SQL = f"""
    SELECT a.run_id, r.workflow_definition_id, r.workflow_version, r.status, a.active_tasks,
           a.oldest_created_at, extract(epoch FROM %(now)s::timestamptz - a.oldest_created_at)::float8 AS oldest_age_s
      FROM (SELECT run_id, count(*) AS active_tasks, min(created_at) AS oldest_created_at
              FROM task_instances
             WHERE state IN {ACTIVE_SQL}
             GROUP BY run_id
             ORDER BY count(*) DESC, min(created_at), run_id
             LIMIT %(limit)s) a
      LEFT JOIN workflow_runs r ON r.id = a.run_id
     ORDER BY a.active_tasks DESC, a.oldest_created_at, a.run_id
"""

# MAP items per queue, from the active rows only (the partial index): a MAP node's own
# row is WAITING while its items run and carries the queue of its items and its
# counters, so the items not dispatched yet (items_total - items_started) are read
# from the node rows, never counted item by item, and no join with the outbox is needed.
MAP_ITEMS_SQL = f"""
    SELECT queue,
           count(*) FILTER (WHERE item_index IS NOT NULL AND state = 'RUNNING') AS running,
           count(*) FILTER (WHERE item_index IS NOT NULL AND state IN ('PENDING', 'QUEUED')) AS pending,
           COALESCE(sum(items_total - items_started) FILTER (WHERE item_index IS NULL), 0)::bigint AS held,
           count(DISTINCT run_id) AS runs
      FROM task_instances
     WHERE state IN {ACTIVE_SQL} AND node_type = 'MAP'
     GROUP BY queue
     ORDER BY queue
"""

# The outbox is a queue (rows are deleted at claim), so it is small and read whole.
OUTBOX_SQL = """
    SELECT queue, count(*) AS rows,
           count(*) FILTER (WHERE available_at <= %(now)s::timestamptz) AS ready,
           count(*) FILTER (WHERE available_at > %(now)s::timestamptz) AS delayed,
           min(available_at) AS oldest_available_at,
           COALESCE(max(extract(epoch FROM %(now)s::timestamptz - available_at))
                        FILTER (WHERE available_at <= %(now)s::timestamptz), 0)::float8 AS oldest_ready_age_s,
           max(available_at) FILTER (WHERE available_at > %(now)s::timestamptz) AS last_delayed_until,
           max(attempt) AS max_attempt
      FROM task_outbox
     GROUP BY queue
     ORDER BY queue
"""


# WAIT_FOR_SIGNAL nodes with no timeout (wake_at NULL) waiting longer than a threshold;
# state = 'WAITING' lies inside the active-state partial index.
LONG_WAITS_SQL = """
    SELECT run_id, id, node_id, signal_name, created_at,
           extract(epoch FROM %(now)s::timestamptz - created_at)::float8 AS waiting_s, count(*) OVER () AS total
      FROM task_instances
     WHERE state = 'WAITING' AND node_type = 'WAIT_FOR_SIGNAL' AND wake_at IS NULL
       AND created_at <= %(now)s::timestamptz - make_interval(secs => %(older_than_s)s)
     ORDER BY created_at, run_id, node_id
     LIMIT %(limit)s
"""


# Timers the coordinator's timer loop should have fired: WAITING tasks whose wake_at has
# passed (a WAIT node's timer, a WAIT_FOR_SIGNAL node's timeout), of runs that are active
# and not soft-deleted, as signals.due_waits selects them. Read through the partial wake
# index (state = 'WAITING' AND wake_at IS NOT NULL); the most overdue row, how many are
# overdue, and how many by more than the threshold. A wake_at at '-infinity' (odd data)
# has no lateness to measure: it is left out.
TIMERS_OVERDUE_SQL = """
    SELECT t.run_id, t.id, t.node_id, t.node_type, t.wake_at,
           extract(epoch FROM %(now)s::timestamptz - t.wake_at)::float8 AS overdue_s,
           count(*) OVER () AS overdue,
           count(*) FILTER (WHERE t.wake_at < %(now)s::timestamptz - make_interval(secs => %(older_than_s)s))
               OVER () AS late
      FROM task_instances t
      JOIN workflow_runs r ON r.id = t.run_id
     WHERE t.state = 'WAITING' AND t.wake_at IS NOT NULL AND t.wake_at <= %(now)s::timestamptz
       AND isfinite(t.wake_at)
       AND r.deleted_at IS NULL AND r.status IN ('PENDING', 'RUNNING')
     ORDER BY t.wake_at, t.run_id, t.node_id
     LIMIT %(limit)s
"""


# Active tasks their run's definition does not explain: the run's definition version row
# is missing (one row per run, node_id NULL), or it has no node of the task's node_id (one
# row per run and node: a MAP node's items count as its tasks). The active-state predicate
# picks the rows through the partial index; each one's run and definition are read by key.
# A spec node's id is matched by containment, as definition_graph reads it ("nodes": [{"id"}]).
# An active task whose run row is gone is one row per run too, its status and node_id NULL.
DEFINITION_MISMATCHES_SQL = f"""
    WITH odd AS MATERIALIZED (
        SELECT t.run_id, r.workflow_definition_id AS workflow_id, r.workflow_version, r.status,
               CASE WHEN d.id IS NOT NULL THEN t.node_id END AS node_id, t.node_type, t.state, t.created_at
          FROM task_instances t
          LEFT JOIN workflow_runs r ON r.id = t.run_id      -- no key holds them together (V011): may be gone
          LEFT JOIN workflow_definitions d ON d.id = r.workflow_definition_id AND d.version = r.workflow_version
         WHERE t.state IN {ACTIVE_SQL}
           AND (d.id IS NULL OR NOT COALESCE(
                    d.spec_json -> 'nodes' @> jsonb_build_array(jsonb_build_object('id', t.node_id)), false)))
    SELECT run_id, workflow_id, workflow_version, status, node_id,
           CASE WHEN node_id IS NOT NULL THEN min(node_type) END AS node_type, count(*) AS tasks,
           string_agg(DISTINCT state, ', ' ORDER BY state) AS states, min(created_at) AS oldest_created_at,
           extract(epoch FROM %(now)s::timestamptz - min(created_at))::float8 AS oldest_age_s,
           count(*) OVER () AS total
      FROM odd
     GROUP BY run_id, workflow_id, workflow_version, status, node_id
     ORDER BY min(created_at), run_id, node_id NULLS FIRST
     LIMIT %(limit)s
"""


def active_tasks(conn: Conn, limit: int) -> list[Row]:
    """The ``limit`` oldest active tasks: run_id, task_id, node_id, node_type, queue,
    state, attempt, created_at, updated_at, wake_at, signal_name, age_s."""
    return _rows(conn, ACTIVE_TASKS_SQL, {"limit": limit})


def active_by_group(conn: Conn) -> list[Row]:
    """Per state x queue x node type: state, queue, node_type, tasks, and the oldest
    task's created_at, age_s, run_id, node_id."""
    return _rows(conn, ACTIVE_BY_GROUP_SQL)


def age_histogram(conn: Conn, bounds: list[float]) -> list[Row]:
    """Active tasks per age bucket (``width_bucket`` over ``bounds``, 0-based) and state."""
    return _rows(conn, AGE_HISTOGRAM_SQL, {"bounds": bounds})


def active_run_count(conn: Conn) -> int:
    """How many runs have at least one active task."""
    row = conn.execute(ACTIVE_RUN_COUNT_SQL.encode()).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def top_runs(conn: Conn, limit: int) -> list[Row]:
    """Runs with the most active tasks: run_id, workflow_id, workflow_version, status,
    active_tasks, oldest_created_at, oldest_age_s."""
    return _rows(conn, TOP_RUNS_SQL, {"limit": limit})


def long_waits(conn: Conn, older_than_s: float, limit: int) -> list[Row]:
    """WAIT_FOR_SIGNAL tasks without a timeout waiting longer than ``older_than_s``,
    oldest first: run_id, task_id, node_id, signal_name, created_at, waiting_s, and
    total (how many there are in all, whatever ``limit``)."""
    return _rows(conn, LONG_WAITS_SQL, {"older_than_s": older_than_s, "limit": limit})


# Dispatches past their schedule_to_start deadline (start_by) still in the outbox: the
# coordinator's timer loop fails their tasks within a pass (outbox.unstarted selects them),
# through the outbox's partial start_by index. The most overdue row, how many are overdue,
# and how many by more than the threshold.
STARTS_OVERDUE_SQL = """
    SELECT run_id, task_id, start_by, extract(epoch FROM %(now)s::timestamptz - start_by)::float8 AS overdue_s,
           count(*) OVER () AS overdue,
           count(*) FILTER (WHERE start_by < %(now)s::timestamptz - make_interval(secs => %(older_than_s)s))
               OVER () AS late
      FROM task_outbox
     WHERE start_by <= %(now)s::timestamptz AND isfinite(start_by)
     ORDER BY start_by, run_id, task_id
     LIMIT %(limit)s
"""


def starts_overdue(conn: Conn, older_than_s: float, limit: int) -> list[Row]:
    """Dispatches past their schedule_to_start deadline, most overdue first: run_id,
    task_id, start_by, overdue_s, overdue (how many in all) and late (how many by more
    than ``older_than_s``)."""
    return _rows(conn, STARTS_OVERDUE_SQL, {"older_than_s": older_than_s, "limit": limit})


def timers_overdue(conn: Conn, older_than_s: float, limit: int) -> list[Row]:
    """WAITING tasks whose timer (wake_at) has passed, of active runs, most overdue first:
    run_id, task_id, node_id, node_type, wake_at, overdue_s, overdue (how many in all,
    whatever ``limit``) and late (how many by more than ``older_than_s``)."""
    return _rows(conn, TIMERS_OVERDUE_SQL, {"older_than_s": older_than_s, "limit": limit})


def definition_mismatches(conn: Conn, limit: int) -> list[Row]:
    """Active runs whose definition version is missing (node_id NULL) and active tasks
    for nodes their run's definition lacks, oldest first: run_id, workflow_id,
    workflow_version, status, node_id, node_type, tasks, states, oldest_created_at,
    oldest_age_s, and total (how many rows there are in all, whatever ``limit``)."""
    return _rows(conn, DEFINITION_MISMATCHES_SQL, {"limit": limit})


def map_items(conn: Conn) -> list[Row]:
    """Active MAP items per queue: queue, running, pending (dispatched or not), held
    (not dispatched yet, by the WAITING MAP nodes' counters), runs."""
    return _rows(conn, MAP_ITEMS_SQL)


def outbox_backlog(conn: Conn) -> list[Row]:
    """Per queue: rows, ready, delayed, oldest_available_at, oldest_ready_age_s,
    last_delayed_until, max_attempt."""
    return _rows(conn, OUTBOX_SQL)


# -- leases ------------------------------------------------------------------------

RUNNING_LEASES_SQL = f"""
    SELECT run_id, id, node_id, COALESCE(queue, '') AS queue, lease_owner, attempt, started_at,
           lease_expires_at,
           {_seconds_until("lease_expires_at")} AS expires_in_s,
           extract(epoch FROM %(now)s::timestamptz - started_at)::float8 AS running_s
      FROM task_instances
     WHERE state = 'RUNNING'
     ORDER BY lease_expires_at NULLS FIRST, run_id, id
"""

ATTEMPTS_SQL = f"""
    SELECT attempt, state, count(*) AS tasks
      FROM task_instances
     WHERE state IN {ACTIVE_SQL}
     GROUP BY attempt, state
     ORDER BY attempt, state
"""

REQUEUES_SQL = f"""
    SELECT run_id, id, node_id, node_type, COALESCE(queue, '') AS queue, state, attempt, updated_at,
           extract(epoch FROM %(now)s::timestamptz - updated_at)::float8 AS since_s,
           COALESCE(last_error ->> 'error', last_error::text) AS last_error
      FROM task_instances
     WHERE state IN {ACTIVE_SQL}
       AND attempt > 0
       AND updated_at >= %(now)s::timestamptz - make_interval(secs => %(window_s)s)
     ORDER BY updated_at DESC, run_id, id
     LIMIT %(limit)s
"""


def running_leases(conn: Conn) -> list[Row]:
    """Every RUNNING task: run_id, task_id, node_id, queue, lease_owner, attempt,
    started_at, lease_expires_at, expires_in_s, running_s (no lease first)."""
    return _rows(conn, RUNNING_LEASES_SQL)


def attempt_distribution(conn: Conn) -> list[Row]:
    """Active tasks per attempt and state: attempt, state, tasks."""
    return _rows(conn, ATTEMPTS_SQL)


def recent_requeues(conn: Conn, window_s: float, limit: int) -> list[Row]:
    """Active tasks on a retry changed within ``window_s``: run_id, task_id, node_id,
    node_type, queue, state, attempt, updated_at, since_s, last_error."""
    return _rows(conn, REQUEUES_SQL, {"window_s": window_s, "limit": limit})


# -- the server read from ------------------------------------------------------------

# On a hot standby: when the last replayed transaction committed on the primary, and
# the replay lag. A standby that has replayed all the WAL it received is as current as
# its stream (lag 0, however long ago the primary last committed); otherwise the lag
# is how far behind the clock its last replayed commit is.
REPLICATION_SQL = """
    SELECT pg_is_in_recovery(), pg_last_xact_replay_timestamp(),
           CASE WHEN NOT pg_is_in_recovery() THEN NULL
                WHEN pg_last_wal_receive_lsn() IS NOT NULL
                     AND pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0
                ELSE GREATEST(extract(epoch FROM now() - pg_last_xact_replay_timestamp()), 0) END::float8,
           (SELECT CASE WHEN pid IS NOT NULL THEN COALESCE(status, 'running') END FROM pg_stat_wal_receiver)
"""


def replication(conn: Conn) -> Row:
    """in_recovery (a standby), last_replay_at, replay_lag_s (None on a primary),
    wal_receiver: its status ('streaming' while it follows the primary; 'running' for a
    role not allowed to see it, which needs pg_read_all_stats), None when none runs."""
    return _rows(conn, REPLICATION_SQL)[0]


# -- webhooks ----------------------------------------------------------------------

# Deliveries still being retried (the relay's partial index covers this predicate).
WEBHOOKS_FAILING_SQL = """
    SELECT count(*), COALESCE(max(attempts), 0), min(created_at)
      FROM webhook_deliveries
     WHERE delivered_at IS NULL AND gave_up_at IS NULL AND attempts >= %(attempts)s
"""


def webhooks_failing(conn: Conn, attempts: int) -> Row:
    """Deliveries not delivered nor given up after at least ``attempts`` tries:
    count, the most attempts, the oldest created_at."""
    row = conn.execute(WEBHOOKS_FAILING_SQL.encode(), {"attempts": attempts}).fetchone()
    assert row is not None
    return tuple(row)


FAILING_DELIVERIES_SQL = """
    SELECT id, run_id::text, url, attempts, last_status, last_error, next_attempt_at, created_at
      FROM webhook_deliveries
     WHERE delivered_at IS NULL AND gave_up_at IS NULL AND attempts >= %(attempts)s
     ORDER BY created_at, id
     LIMIT %(limit)s
"""


def failing_deliveries(conn: Conn, attempts: int, limit: int) -> list[Row]:
    """The deliveries :func:`webhooks_failing` counts, oldest first, at most ``limit``:
    id, run, url, attempts, last status, last error, next attempt, created."""
    return [tuple(r) for r in conn.execute(FAILING_DELIVERIES_SQL.encode(), {"attempts": attempts, "limit": limit})]


# -- one run -----------------------------------------------------------------------

# The partition the row is read from; on Citus that is a shard of it, named after the
# partition with the shard's number appended ("workflow_runs_p202612_102008").
RUN_SQL = """
    SELECT r.id, r.workflow_definition_id, r.workflow_version, r.status, r.created_at, r.updated_at,
           r.completed_at, extract(epoch FROM COALESCE(r.completed_at, %(now)s::timestamptz) - r.created_at)::float8,
           r.input_json::text, r.output_json::text, COALESCE(r.error_json ->> 'error', r.error_json::text),
           regexp_replace(r.tableoid::regclass::text, '_[0-9]+$', ''), r.deleted_at, d.spec_json
      FROM workflow_runs r
      LEFT JOIN workflow_definitions d ON d.id = r.workflow_definition_id AND d.version = r.workflow_version
     WHERE r.id = %(run)s
"""

RUN_TASKS_SQL = f"""
    SELECT id, node_id, node_type, queue, state, attempt, created_at, started_at, finished_at, updated_at,
           extract(epoch FROM COALESCE(started_at, finished_at, %(now)s::timestamptz) - created_at)::float8 AS queued_s,
           extract(epoch FROM COALESCE(finished_at, %(now)s::timestamptz) - started_at)::float8 AS ran_s,
           wake_at, {_seconds_until("wake_at")} AS wakes_in_s, signal_name,
           lease_owner, lease_expires_at, {_seconds_until("lease_expires_at")} AS lease_left_s,
           COALESCE(last_error ->> 'error', last_error::text) AS last_error, branches, output_json::text
      FROM task_instances
     WHERE run_id = %(run)s AND item_index IS NULL
     ORDER BY created_at, node_id
"""

RUN_ITEM_STATES_SQL = """
    SELECT node_id, state, count(*) FROM task_instances
     WHERE run_id = %(run)s AND item_index IS NOT NULL
     GROUP BY node_id, state
     ORDER BY node_id, state
"""

RUN_MAP_NODES_SQL = """
    SELECT node_id, state, items_total, items_started, items_done, items_failed FROM task_instances
     WHERE run_id = %(run)s AND item_index IS NULL AND node_type = 'MAP'
     ORDER BY node_id
"""

RUN_SLOWEST_ITEMS_SQL = """
    SELECT node_id, item_index, state, attempt, started_at, finished_at, ran_s FROM (
        SELECT node_id, item_index, state, attempt, started_at, finished_at,
               extract(epoch FROM COALESCE(finished_at, %(now)s::timestamptz) - started_at)::float8 AS ran_s,
               row_number() OVER (PARTITION BY node_id
                                  ORDER BY COALESCE(finished_at, %(now)s::timestamptz) - started_at DESC,
                                           item_index) AS rank
          FROM task_instances
         WHERE run_id = %(run)s AND item_index IS NOT NULL AND started_at IS NOT NULL) ranked
     WHERE rank <= %(limit)s
     ORDER BY node_id, rank
"""

RUN_PARENT_SQL = """
    SELECT parent_node_id, parent_run_id FROM workflow_runs WHERE id = %(run)s AND parent_run_id IS NOT NULL
"""

RUN_CHILDREN_SQL = """
    SELECT DISTINCT node_id, detail->>'child' FROM run_history
     WHERE run_id = %(run)s AND kind = 'child_started'
"""

LINKED_RUN_SQL = """
    SELECT workflow_definition_id, status FROM workflow_runs WHERE id = %(run)s
"""

RUN_SIGNALS_SQL = """
    SELECT id, name, payload::text, created_at, consumed_at,
           CASE WHEN consumed_at IS NULL THEN 'buffered' ELSE 'consumed' END,
           extract(epoch FROM COALESCE(consumed_at, %(now)s::timestamptz) - created_at)::float8
      FROM workflow_events
     WHERE run_id = %(run)s
     ORDER BY created_at, id
"""

RUN_HISTORY_SQL = """
    SELECT seq, at, kind, node_id, task_id, attempt, worker, request, detail::text
      FROM run_history
     WHERE run_id = %(run)s
     ORDER BY seq
"""

RUN_OUTBOX_SQL = """
    SELECT task_id, queue, attempt, task_name, lease_s, available_at,
           extract(epoch FROM available_at - %(now)s::timestamptz)::float8
      FROM task_outbox
     WHERE run_id = %(run)s
     ORDER BY available_at, id
"""

RUN_WEBHOOK_SQL = """
    SELECT url, attempts, next_attempt_at, delivered_at, gave_up_at, last_status, last_error, created_at
      FROM webhook_deliveries
     WHERE run_id = %(run)s
"""

# Walks the run-ID primary key from the newest end of each partition.
LATEST_RUN_SQL = """
    SELECT id FROM workflow_runs
     WHERE (%(status)s::text IS NULL OR status = %(status)s) AND deleted_at IS NULL
     ORDER BY id DESC LIMIT 1
"""


def run_row(conn: Conn, run_id: str) -> Row | None:
    """The run: run_id, workflow_id, workflow_version, status, created_at, updated_at,
    completed_at, duration_s, input, output, error, partition, deleted_at (None unless
    ``runs delete`` deleted it), and last its definition's spec_json (None when that
    version is missing)."""
    rows = _rows(conn, RUN_SQL, {"run": run_id})
    return rows[0] if rows else None


def run_tasks(conn: Conn, run_id: str) -> list[Row]:
    """Every task of the run with its timings, lease, last error, branches and output."""
    return _rows(conn, RUN_TASKS_SQL, {"run": run_id})


def run_item_states(conn: Conn, run_id: str) -> list[Row]:
    """How many items of each MAP node of the run are in each state: node_id, state, items."""
    return _rows(conn, RUN_ITEM_STATES_SQL, {"run": run_id})


def run_map_nodes(conn: Conn, run_id: str) -> list[Row]:
    """The run's MAP nodes with their counters: node_id, state, items_total,
    items_started, items_done, items_failed."""
    return _rows(conn, RUN_MAP_NODES_SQL, {"run": run_id})


def run_slowest_items(conn: Conn, run_id: str, limit: int = 5) -> list[Row]:
    """The ``limit`` longest-running items of each MAP node of the run (still running
    ones by their time so far): node_id, item_index, state, attempt, started_at,
    finished_at, ran_s."""
    return _rows(conn, RUN_SLOWEST_ITEMS_SQL, {"run": run_id, "limit": limit})


def run_links(conn: Conn, run_id: str) -> list[Row]:
    """The run's parent (when a SUB_WORKFLOW node started it) and its children: link
    ('parent' or 'child'), node_id (the SUB_WORKFLOW node), run_id, workflow_id, status
    (None for a linked run that is gone). The children are named by the run's own
    history; each linked run is then read by its ID: on Citus, one shard per statement."""
    found: list[tuple[str, str, str]] = [("parent", str(n), str(p)) for n, p in _rows(conn, RUN_PARENT_SQL,
                                                                                     {"run": run_id})]
    found += sorted(("child", str(n), str(c)) for n, c in _rows(conn, RUN_CHILDREN_SQL, {"run": run_id}))
    rows: list[Row] = []
    for link, node_id, other in found:
        row = _rows(conn, LINKED_RUN_SQL, {"run": other})
        workflow, status = row[0] if row else (None, None)
        rows.append((link, node_id, other, workflow, status))
    return rows


def run_signals(conn: Conn, run_id: str) -> list[Row]:
    """Signals sent to the run: signal_id, name, payload, created_at, consumed_at,
    status ('buffered' or 'consumed'), buffered_s."""
    return _rows(conn, RUN_SIGNALS_SQL, {"run": run_id})


def run_history(conn: Conn, run_id: str) -> list[Row]:
    """The run's history, oldest first: seq, at, kind, node_id, task_id, attempt,
    worker, request, detail (JSON text)."""
    return _rows(conn, RUN_HISTORY_SQL, {"run": run_id})


def run_outbox(conn: Conn, run_id: str) -> list[Row]:
    """Dispatches of the run not yet claimed: task_id, queue, attempt, task_name,
    lease_s, available_at, available_in_s."""
    return _rows(conn, RUN_OUTBOX_SQL, {"run": run_id})


def run_webhook(conn: Conn, run_id: str) -> list[Row]:
    """The run's webhook delivery: url, attempts, next_attempt_at, delivered_at,
    gave_up_at, last_status, last_error, created_at."""
    return _rows(conn, RUN_WEBHOOK_SQL, {"run": run_id})


def latest_run_id(conn: Conn, status: str | None) -> str | None:
    """The newest run not deleted (with ``status``, if given)."""
    row = conn.execute(LATEST_RUN_SQL.encode(), {"status": status}).fetchone()
    return None if row is None else str(row[0])


def definition_spec(conn: Conn, workflow_id: str, version: int) -> Any:
    """The spec_json of one definition version, or None when that version is missing."""
    row = conn.execute("SELECT spec_json FROM workflow_definitions WHERE id = %s AND version = %s",
                       (workflow_id, version)).fetchone()
    return None if row is None else row[0]
