"""Task instances: insert, the fenced updates, leases.

Every update repeats the state machine's fencing check in its WHERE clause (id,
node_id, attempt, an in-flight state). The machine already checked under the run lock;
this is defence in depth: if anything wrote to the task outside the engine, the
update matches zero rows and the shell rolls the transaction back.

Completions, failures and re-queues are written, fenced the same way and each with its
run-history row, by the event's one write (sql/R__apply.sql, composer_ops/repo/writes.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from composer_ops.core.model import ACTIVE_TASK_STATES, TaskRef
from composer_ops.errors import ComposerError
from composer_ops.repo import partitions, writes
from composer_ops.repo._base import Conn, error_json, fetch_all, sql_states
from composer_ops.repo.rows import ExpiredLease, NewTask

_ACTIVE = sql_states(ACTIVE_TASK_STATES)


def insert_task(conn: Conn, run_id: str, *, task_id: str, node_id: str, node_type: str,
                queue: str | None, state: str, input: Any = None, output: Any = None,
                error: str | None = None, branches: Sequence[str] | None = None,
                wake_at: datetime | None = None, signal_name: str | None = None, now: datetime) -> bool:
    """Insert the task a CreateTask action describes, created at ``now``:
    :func:`insert_tasks` with one row."""
    insert_tasks(conn, run_id, [NewTask(
        task_id=task_id, node_id=node_id, node_type=node_type, queue=queue, state=state, input=input,
        output=output, error=error, branches=branches, wake_at=wake_at, signal_name=signal_name)], now=now)
    return True


def insert_tasks(conn: Conn, run_id: str, rows: Sequence[NewTask], *, now: datetime) -> None:
    """Insert the tasks of CreateTask actions decided at ``now``, through an event's one
    write (:mod:`composer_ops.repo.writes`), which is how the shell
    inserts them: what seeds and tests use. A (run, node) that already has a task is a
    Conflict (and the caller's transaction aborted)."""
    if rows:
        writes.send(conn, writes.document(at=now, run_id=run_id, request=None, tasks=rows)).result()


def cancel_tasks(conn: Conn, run_id: str, task_ids: Sequence[str], reason: str, *, now: datetime) -> int:
    """Move the given active tasks of a run to CANCELLED at ``now``; returns how many moved."""
    if not task_ids:
        return 0
    cur = conn.execute(f"""
        UPDATE task_instances
           SET state = 'CANCELLED', last_error = %s, finished_at = %s, updated_at = %s,
               lease_owner = NULL, lease_expires_at = NULL
         WHERE run_id = %s AND id = ANY(%s)
           AND state IN {_ACTIVE}""",
        (error_json(reason), now, now, run_id, list(task_ids)))
    return cur.rowcount


def reset_tasks(conn: Conn, run_id: str, task_ids: Sequence[str]) -> int:
    """Remove finished tasks of a finished run that a retry runs again
    (``composer_reset_tasks``, which the engine role may call but whose DELETE it may
    not run itself); returns how many were removed."""
    if not task_ids:
        return 0
    row = conn.execute("SELECT composer_reset_tasks(%s, %s)", (run_id, list(task_ids))).fetchone()
    return int(row[0]) if row else 0


_HEARTBEAT = """
        UPDATE {tasks}
           SET lease_expires_at = LEAST(NOW() + make_interval(secs => %s), run_deadline_at)
         WHERE run_id = %s AND id = %s AND attempt = %s AND state = 'RUNNING'
           AND lease_owner = %s AND lease_expires_at > NOW()
        RETURNING lease_expires_at"""


def heartbeat(conn: Conn, ref: TaskRef, owner: str, lease_s: float) -> datetime | None:
    """Extend a live lease by ``lease_s`` from the database clock, never past the
    attempt's start_to_close deadline (``run_deadline_at``, set by the claim). None when the lease
    is lost (expired, re-queued, cancelled or owned by someone else, or its month's
    partition is gone). Touches only lease_expires_at, so the update can stay HOT.
    On the run's month partition (:func:`partitions.run_tables`), in a transaction of
    its own: a partition dropped since it was checked fails it, and nothing else."""
    runs, tasks = partitions.run_tables(conn, ref.run_id)
    try:
        row = conn.execute(partitions.on_tables(_HEARTBEAT, runs, tasks),
                           (lease_s, ref.run_id, ref.task_id, ref.attempt, owner)).fetchone()
    except ComposerError as exc:
        if not partitions.gone_since_checked(conn, ref.run_id, tasks, exc):
            raise
        return None
    return None if row is None else row[0]


def active_floor(conn: Conn) -> str | None:
    """The smallest run ID that has a task in an active state (PENDING, QUEUED, RUNNING,
    WAITING), None when no task is active. Read through the partial index of active
    tasks, partition by partition in run-ID order, it stops at the first month that has
    one; like every statement without a run ID, it plans and locks every month."""
    row = conn.execute(f"SELECT min(run_id) FROM task_instances WHERE state IN {_ACTIVE}").fetchone()
    return None if row is None else row[0]


def active_ceiling(conn: Conn) -> str | None:
    """The greatest run ID that has an active task, None when no task is active
    (:func:`active_floor`'s other end)."""
    row = conn.execute(f"SELECT max(run_id) FROM task_instances WHERE state IN {_ACTIVE}").fetchone()
    return None if row is None else row[0]


def expired_leases(conn: Conn, limit: int, *, now: datetime, skip: Sequence[str] = (),
                   floor: str = "") -> list[ExpiredLease]:
    """RUNNING tasks whose lease had lapsed at ``now`` (the database clock), oldest first,
    of runs that are active and not soft-deleted; ``skip``: ``task_id:attempt`` keys of
    attempts the caller is backing off. Only runs whose ID is ``floor`` or above: the
    planner keeps only the months from ``floor``'s on, so a floor below which no task is
    active (:func:`active_floor`) makes the scan's cost independent of the months of
    finished history retained; the default scans every month. Sent unprepared, so it is
    planned with the floor's value at every call: a cached generic plan keeps every
    month and locks them all before it prunes (PostgreSQL 15 to 18), and the plan cache
    may settle on one while the partitions are few and empty (a test on PostgreSQL 15
    saw it)."""
    return fetch_all(conn, ExpiredLease, """
        SELECT t.run_id, t.id AS task_id, t.node_id, t.attempt, t.lease_owner,
               COALESCE(t.lease_expires_at >= t.run_deadline_at, false) AS timed_out
          FROM task_instances t
          JOIN workflow_runs r ON r.id = t.run_id
         WHERE t.state = 'RUNNING' AND t.lease_expires_at <= %(now)s
           AND t.id || ':' || t.attempt <> ALL(%(skip)s::text[])
           AND t.run_id >= %(floor)s AND r.id >= %(floor)s
           AND r.deleted_at IS NULL AND r.status IN ('PENDING', 'RUNNING')
         ORDER BY t.lease_expires_at
         LIMIT %(limit)s""", {"now": now, "skip": list(skip), "limit": limit, "floor": floor}, prepare=False)
