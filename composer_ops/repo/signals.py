"""Waits and signals: due timers, resolving waits, buffered signals."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from composer_ops.core.model import Signal
from composer_ops.repo._base import Conn, fetch_all, jsonb
from composer_ops.repo.rows import DueWait


def due_waits(conn: Conn, limit: int, *, now: datetime, skip: Sequence[str] = (),
              floor: str = "") -> list[DueWait]:
    """Up to ``limit`` WAITING tasks whose wake_at had passed at ``now`` (the database
    clock), oldest first (served by the partial wake index), of runs that are active and
    not soft-deleted; ``skip``: task ids the caller is backing off, so the rows behind
    them get their turn. Only runs whose ID is ``floor`` or above, which keeps the
    months below it out of the plan; sent unprepared for that (``tasks.expired_leases``
    says why)."""
    return fetch_all(conn, DueWait, """
        SELECT t.run_id, t.id AS task_id, t.node_id
          FROM task_instances t
          JOIN workflow_runs r ON r.id = t.run_id
         WHERE t.state = 'WAITING' AND t.wake_at <= %(now)s AND t.id <> ALL(%(skip)s::text[])
           AND t.run_id >= %(floor)s AND r.id >= %(floor)s
           AND r.deleted_at IS NULL AND r.status IN ('PENDING', 'RUNNING')
         ORDER BY t.wake_at
         LIMIT %(limit)s""", {"now": now, "skip": list(skip), "limit": limit, "floor": floor}, prepare=False)


def buffer_signal(conn: Conn, run_id: str, *, signal_id: str, name: str, payload: Any, now: datetime) -> None:
    """Store a signal, received at ``now``, until a WAIT_FOR_SIGNAL node consumes it."""
    conn.execute("INSERT INTO workflow_events (id, run_id, name, payload, created_at) VALUES (%s, %s, %s, %s, %s)",
                 (signal_id, run_id, name, jsonb(payload), now))


def pending_signals(conn: Conn, run_id: str, name: str, *, limit: int = 100) -> list[Signal]:
    """Unconsumed signals of that name, oldest first (the partial pending index)."""
    return fetch_all(conn, Signal, """
        SELECT id, name, payload FROM workflow_events
         WHERE run_id = %s AND name = %s AND consumed_at IS NULL
         ORDER BY created_at, id
         LIMIT %s""", (run_id, name, limit))


def consume_signal(conn: Conn, run_id: str, signal_id: str, *, now: datetime) -> bool:
    """Mark a buffered signal as used at ``now``; False if it was already consumed."""
    cur = conn.execute(
        "UPDATE workflow_events SET consumed_at = %s WHERE run_id = %s AND id = %s AND consumed_at IS NULL",
        (now, run_id, signal_id))
    return cur.rowcount == 1

