"""The workers registry (``workers``): who serves which queues, and who went silent.

A worker registers when it starts, refreshes ``last_seen_at`` once per heartbeat
interval and sets ``stopped_at`` when it stops cleanly. Live or dead is judged by the
database clock: a worker not seen for :data:`DEAD_AFTER` intervals, and not stopped,
is dead. The leases a worker holds are the RUNNING tasks naming it as
``lease_owner`` (read through the partial index on RUNNING tasks, which holds only
live work).
"""

from __future__ import annotations

from collections.abc import Sequence

from composer_ops.repo._base import Conn, fetch_all
from composer_ops.repo.rows import LeaseRow, WorkerRow

#: Heartbeat intervals without a sign of life after which a worker counts as dead.
DEAD_AFTER = 3


def register(conn: Conn, worker_id: str, *, host: str, pid: int, queues: Sequence[str], concurrency: int,
             heartbeat_s: float) -> None:
    """Record a worker that starts (again, if the id was seen before)."""
    conn.execute("""
        INSERT INTO workers (id, host, pid, queues, concurrency, heartbeat_s)
        VALUES (%s, %s, %s, %s, %s, %s)
        ON CONFLICT (id) DO UPDATE
           SET host = EXCLUDED.host, pid = EXCLUDED.pid, queues = EXCLUDED.queues,
               concurrency = EXCLUDED.concurrency, heartbeat_s = EXCLUDED.heartbeat_s,
               started_at = now(), last_seen_at = now(), stopped_at = NULL""",
        (worker_id, host, pid, list(queues), concurrency, heartbeat_s))


def beat(conn: Conn, worker_id: str) -> bool:
    """The worker is alive now; False when it is not registered (then register it)."""
    cur = conn.execute("UPDATE workers SET last_seen_at = now() WHERE id = %s AND stopped_at IS NULL",
                       (worker_id,))
    return cur.rowcount == 1


def stopped(conn: Conn, worker_id: str) -> None:
    """The worker stopped cleanly (its registration as a waiter goes first:
    :func:`composer_ops.repo.outbox.unregister`)."""
    conn.execute("UPDATE workers SET last_seen_at = now(), stopped_at = now() WHERE id = %(w)s", {"w": worker_id})


def list_workers(conn: Conn, *, window_s: float | None = None) -> list[WorkerRow]:
    """Every worker seen in the last ``window_s`` seconds (all when None), plus every worker
    still holding a RUNNING task's lease, with its state and lease counts; live ones
    first, then dead, then stopped, newest first within each."""
    return fetch_all(conn, WorkerRow, f"""
        WITH leases AS MATERIALIZED (
            SELECT lease_owner, count(*) AS running,
                   count(*) FILTER (WHERE lease_expires_at <= now()) AS expired
              FROM task_instances
             WHERE state = 'RUNNING' AND lease_owner IS NOT NULL
             GROUP BY lease_owner)
        SELECT w.id, w.host, w.pid, w.queues, w.concurrency, w.heartbeat_s,
               w.started_at, w.last_seen_at, w.stopped_at,
               CASE WHEN w.stopped_at IS NOT NULL THEN 'stopped'
                    WHEN w.last_seen_at < now() - make_interval(secs => {DEAD_AFTER} * w.heartbeat_s)
                         THEN 'dead'
                    ELSE 'live' END AS state,
               extract(epoch FROM now() - w.last_seen_at)::float8 AS silent_s,
               COALESCE(l.running, 0) AS running, COALESCE(l.expired, 0) AS expired
          FROM workers w
          LEFT JOIN leases l ON l.lease_owner = w.id
         WHERE %(window)s::float8 IS NULL OR w.last_seen_at >= now() - make_interval(secs => %(window)s)
            OR l.running > 0
         ORDER BY CASE WHEN w.stopped_at IS NOT NULL THEN 2
                       WHEN w.last_seen_at < now() - make_interval(secs => {DEAD_AFTER} * w.heartbeat_s) THEN 1
                       ELSE 0 END,
                  w.last_seen_at DESC, w.id""", {"window": window_s})


def leases_of(conn: Conn, worker_ids: Sequence[str]) -> list[LeaseRow]:
    """The RUNNING tasks leased to these workers, expired ones first."""
    if not worker_ids:
        return []
    return fetch_all(conn, LeaseRow, """
        SELECT lease_owner, run_id, id AS task_id, node_id, attempt, lease_expires_at,
               COALESCE(lease_expires_at <= now(), false) AS expired
          FROM task_instances
         WHERE state = 'RUNNING' AND lease_owner = ANY(%s)
         ORDER BY lease_owner, lease_expires_at, run_id, id""", (list(worker_ids),))


def unregistered_owners(conn: Conn) -> list[str]:
    """Lease owners of RUNNING tasks that never registered (a worker from before the
    registry, or one whose registration failed)."""
    return [str(r[0]) for r in conn.execute("""
        SELECT DISTINCT t.lease_owner FROM task_instances t
         WHERE t.state = 'RUNNING' AND t.lease_owner IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM workers w WHERE w.id = t.lease_owner)
         ORDER BY 1""").fetchall()]
