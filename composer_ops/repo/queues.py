"""Queue settings an operator sets (``queue_settings``, sql/V003) and what each queue
holds: ``composer-ops queues``, ``check`` and the active_tasks report read them.

Every claim reads the settings of its queues (sql/R__claim.sql): a paused queue gives
no task, a queue with ``max_running`` gives at most that many RUNNING attempts, counted
in ``flow_slots``. A change locks the queue's row first (:func:`lock`), creating it when
the queue has none, so two changes of one queue, or a retried change and its earlier
attempt still committing, serialise on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from composer_ops.repo._base import Conn, fetch_all
from composer_ops.repo.rows import KeyAtLimit, QueueRow, QueueSetting, RateWait, StartLatency

_SETTING = "queue, paused, reason, paused_at, max_running, updated_at"


def settings(conn: Conn, queues: Sequence[str]) -> list[QueueSetting]:
    """The settings rows of ``queues`` that exist, by name."""
    return fetch_all(conn, QueueSetting, f"SELECT {_SETTING} FROM queue_settings WHERE queue = ANY(%s) ORDER BY queue",
                     (list(queues),))


def named(conn: Conn, queue: str) -> bool:
    """Whether anything names ``queue``: a setting, a dispatch, a task, a worker that
    serves it (registered, stopped or not) or a node of a deployed definition (``queue``
    given, or a TASK's ``default``). What a pause of a queue nothing names (a typo) is
    warned of by. The tasks are read through their queue's dispatches and RUNNING ones."""
    row = conn.execute("""
        SELECT EXISTS (SELECT 1 FROM queue_settings WHERE queue = %(q)s)
            OR EXISTS (SELECT 1 FROM task_outbox WHERE queue = %(q)s)
            OR EXISTS (SELECT 1 FROM task_instances WHERE state = 'RUNNING' AND queue = %(q)s)
            OR EXISTS (SELECT 1 FROM workers WHERE %(q)s = ANY(queues))
            OR EXISTS (SELECT 1 FROM workflow_definitions d, jsonb_array_elements(d.spec_json -> 'nodes') n
                        WHERE d.deleted_at IS NULL
                          AND COALESCE(n ->> 'queue', CASE WHEN n ->> 'type' = 'TASK' THEN 'default' END) = %(q)s)""",
                       {"q": queue}).fetchone()
    return bool(row and row[0])


def lock(conn: Conn, queue: str) -> tuple[QueueSetting, bool]:
    """Lock ``queue``'s settings row for the rest of the transaction (creating an open,
    unlimited one when there is none) and return it as the lock found it, and whether
    this call created it."""
    created = conn.execute("INSERT INTO queue_settings (queue) VALUES (%s) ON CONFLICT (queue) DO NOTHING "
                           "RETURNING queue", (queue,)).fetchone() is not None
    return fetch_all(conn, QueueSetting, f"SELECT {_SETTING} FROM queue_settings WHERE queue = %s FOR UPDATE",
                     (queue,))[0], created


def hold_running(conn: Conn, queue: str) -> int:
    """A place under ``queue``'s limit for each of its attempts RUNNING without one (claimed
    while the queue had no limit): the limit counts them, so no new attempt starts until
    the queue is under it. How many places were made or taken over. Such a place is freed
    by the coordinator's pass after its attempt ends at the latest (:func:`free_stale_slots`;
    the trigger frees it at once only when the task row's ``flow_slot`` is set, by a claim
    under a concurrency key: setting it here would wait for the row locks of the attempts'
    own reports). A task whose place for the attempt running this snapshot sees is left
    alone, so the insert does not wait for a report ending that attempt. Claims take no
    lock against a change of the settings, so the attempts of a claim under way when the
    change commits hold no place (at most one claim per worker; they run to their end)."""
    # Two materialized reads, then the insert: on Citus the tasks are distributed and the
    # places a coordinator table, which one statement may not join directly. A place of
    # an earlier attempt of the task (ended, not yet freed by the pass) is taken over for
    # the attempt running, as a claim's upsert takes one over (sql/R__claim.sql).
    return conn.execute("""
        WITH held AS MATERIALIZED (
            SELECT f.run_id, f.task_id, f.attempt FROM flow_slots f WHERE f.key = 'queue:' || %(q)s
        ), running AS MATERIALIZED (
            SELECT t.run_id, t.id, t.attempt FROM task_instances t
             WHERE t.state = 'RUNNING' AND t.lease_owner IS NOT NULL AND COALESCE(t.queue, 'default') = %(q)s
        )
        INSERT INTO flow_slots AS f (key, run_id, task_id, attempt)
        SELECT 'queue:' || %(q)s, r.run_id, r.id, r.attempt FROM running r
         WHERE NOT EXISTS (SELECT 1 FROM held h
                            WHERE h.run_id = r.run_id AND h.task_id = r.id AND h.attempt = r.attempt)
        ON CONFLICT (key, run_id, task_id) DO UPDATE SET attempt = EXCLUDED.attempt, taken_at = now()
         WHERE f.attempt < EXCLUDED.attempt""", {"q": queue}).rowcount


def forget(conn: Conn, queue: str) -> None:
    """Delete ``queue``'s settings row (locked by :func:`lock`): an open, unlimited queue needs none."""
    conn.execute("DELETE FROM queue_settings WHERE queue = %s", (queue,))


def update(conn: Conn, queue: str, *, paused: bool, reason: str | None, paused_at: datetime | None,
           max_running: int, now: datetime) -> QueueSetting:
    """Write ``queue``'s settings (its row locked by :func:`lock`)."""
    return fetch_all(conn, QueueSetting, f"""
        UPDATE queue_settings SET paused = %s, reason = %s, paused_at = %s, max_running = %s, updated_at = %s
         WHERE queue = %s
        RETURNING {_SETTING}""", (paused, reason, paused_at, max_running, now, queue))[0]


# Every queue that has a setting, a dispatch or a RUNNING task. The outbox is a queue
# (small, read whole); RUNNING tasks are read through their partial index
# (idx_task_instances_running), bounded by the workers' concurrency.
_OVERVIEW = """
    WITH outbox AS (
        SELECT queue, count(*) AS depth,
               count(*) FILTER (WHERE available_at <= %(now)s::timestamptz) AS ready,
               COALESCE(max(extract(epoch FROM %(now)s::timestamptz - available_at))
                            FILTER (WHERE available_at <= %(now)s::timestamptz), 0)::float8 AS oldest_ready_s
          FROM task_outbox GROUP BY queue
    ), running AS (
        SELECT COALESCE(queue, 'default') AS queue, count(*) AS running
          FROM task_instances WHERE state = 'RUNNING' AND node_type = 'TASK' GROUP BY 1
    ), slots AS (
        SELECT substr(key, 7) AS queue, count(*) AS slots FROM flow_slots WHERE key LIKE 'queue:%%' GROUP BY 1
    ), names AS (
        SELECT queue FROM queue_settings UNION SELECT queue FROM outbox UNION SELECT queue FROM running
    )
    SELECT n.queue, COALESCE(s.paused, false) AS paused, s.reason, s.paused_at,
           CASE WHEN s.paused THEN extract(epoch FROM %(now)s::timestamptz - s.paused_at)::float8 END AS paused_s,
           COALESCE(s.max_running, 0) AS max_running,
           COALESCE(o.depth, 0) AS depth, COALESCE(o.ready, 0) AS ready,
           COALESCE(o.oldest_ready_s, 0) AS oldest_ready_s,
           COALESCE(r.running, 0) AS running, COALESCE(sl.slots, 0) AS slots
      FROM names n
      LEFT JOIN queue_settings s ON s.queue = n.queue
      LEFT JOIN outbox o ON o.queue = n.queue
      LEFT JOIN running r ON r.queue = n.queue
      LEFT JOIN slots sl ON sl.queue = n.queue
     ORDER BY n.queue"""


def overview(conn: Conn, now: datetime) -> list[QueueRow]:
    """Every queue with its settings, its dispatches (depth, ready now, the oldest ready
    one's age) and its RUNNING tasks, ages from ``now`` (the database clock)."""
    return fetch_all(conn, QueueRow, _OVERVIEW, {"now": now})


def free_stale_slots(conn: Conn) -> int:
    """Delete the slots whose attempt is no longer RUNNING: the places a limit made for
    attempts already running (:func:`hold_running`), which no trigger frees, and any a
    change that bypassed the trigger of sql/R__claim.sql left (a row edited by hand); the
    lease sweeper's pass. Few rows: at most the running attempts with a limit."""
    # Each place as this statement's snapshot saw it (attempt and taken_at): a claim of
    # the task's next attempt that takes the place over (its upsert sets both) while this
    # statement waits for the row makes it another place, left alone. A subquery reading
    # the row's own attempt would, rechecked after the wait, compare the new attempt with
    # the task in the old snapshot (not RUNNING at it) and free a place whose attempt runs.
    return conn.execute("""
        DELETE FROM flow_slots f
         USING (SELECT s.key, s.run_id, s.task_id, s.attempt, s.taken_at FROM flow_slots s
                 WHERE NOT EXISTS (SELECT 1 FROM task_instances t
                                    WHERE t.run_id = s.run_id AND t.id = s.task_id AND t.attempt = s.attempt
                                      AND t.state = 'RUNNING')) AS stale
         WHERE f.key = stale.key AND f.run_id = stale.run_id AND f.task_id = stale.task_id
           AND f.attempt = stale.attempt AND f.taken_at = stale.taken_at""").rowcount


def keys_at_limit(conn: Conn, now: datetime) -> list[KeyAtLimit]:
    """Concurrency keys with as many attempts RUNNING as their limit and dispatches ready
    behind them (waiting on purpose), per queue; the outbox read whole, the slots by key."""
    return fetch_all(conn, KeyAtLimit, """
        SELECT w.queue, w.key, w.key_limit, w.waiting, w.oldest_waiting_s, s.running
          FROM (SELECT queue, ckey AS key, max(climit) AS key_limit, count(*) AS waiting,
                       max(extract(epoch FROM %(now)s::timestamptz - available_at))::float8 AS oldest_waiting_s
                  FROM task_outbox WHERE ckey IS NOT NULL AND available_at <= %(now)s::timestamptz
                 GROUP BY queue, ckey) w
          CROSS JOIN LATERAL (SELECT count(*) AS running FROM flow_slots f WHERE f.key = 'c:' || w.key) s
         WHERE s.running >= w.key_limit
         ORDER BY w.waiting DESC, w.queue, w.key""", {"now": now})


def rate_limited(conn: Conn, now: datetime) -> list[RateWait]:
    """Rate limit keys with dispatches ready: how many wait, the oldest's age, the rate,
    and the tokens the bucket held when a claim last looked."""
    return fetch_all(conn, RateWait, """
        SELECT o.rkey AS key, count(*) AS waiting,
               max(extract(epoch FROM %(now)s::timestamptz - o.available_at))::float8 AS oldest_waiting_s,
               max(o.rate_per_s) AS per_s, max(b.tokens) AS tokens
          FROM task_outbox o LEFT JOIN rate_buckets b ON b.key = o.rkey
         WHERE o.rkey IS NOT NULL AND o.available_at <= %(now)s::timestamptz
         GROUP BY o.rkey
         ORDER BY count(*) DESC, o.rkey""", {"now": now})


def start_latency(conn: Conn, *, since: datetime, floor: str) -> list[StartLatency]:
    """Schedule-to-start latency per queue: from a task's creation to its first claim
    (attempt 0, whose dispatch is written with the task), for claims at or after
    ``since``, of runs whose ID is ``floor`` or above (the run-ID bound of ``since``:
    only those months are read, and tasks of older runs are left out)."""
    return fetch_all(conn, StartLatency, """
        SELECT COALESCE(t.queue, 'default') AS queue, count(*) AS claims,
               percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM h.at - t.created_at))::float8 AS p50_s,
               percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM h.at - t.created_at))::float8 AS p95_s
          FROM run_history h
          JOIN task_instances t ON t.run_id = h.run_id AND t.id = h.task_id
         WHERE h.kind = 'claimed' AND h.attempt = 0 AND h.at >= %(since)s
           AND h.run_id >= %(floor)s AND t.run_id >= %(floor)s
         GROUP BY 1
         ORDER BY 1""", {"since": since, "floor": floor}, prepare=False)
