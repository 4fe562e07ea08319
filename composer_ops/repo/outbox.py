"""The dispatch outbox: written with the task in one transaction, claimed by workers.

The claim is one statement, a call of ``composer_claim`` (sql/V013): it deletes the
oldest available outbox rows of the worker's queues (FOR UPDATE SKIP LOCKED, so
claimers never wait on each other), moves the matching tasks to RUNNING with a lease,
fenced on attempt, and writes a 'claimed' row to each run's history marked with the
claim's ID. The task update names the claimed run IDs as constants, so it plans and
locks only their months' partitions, however many months are retained. An outbox row
whose task is no longer PENDING (cancelled, already finished) or whose run was
soft-deleted is deleted and yields nothing.

Lock order: a transaction that touches both a task and its outbox row locks the
outbox row first. The claim does (its DELETE feeds its UPDATE), and so does the
shell when it cancels tasks (:func:`delete_for_tasks` before ``tasks.cancel_tasks``),
so the two can wait for each other but never deadlock. Writing a new outbox row
locks no existing one (a task gets a new dispatch only when it has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from psycopg import sql

from composer_ops.repo._base import Conn, fetch_all
from composer_ops.repo.rows import Claim, Dispatch

#: LISTEN/NOTIFY channel workers wait on; the payload is the queue name.
CHANNEL = "composer_tasks"


def enqueue(conn: Conn, dispatches: Sequence[Dispatch], *, now: datetime) -> None:
    """Write outbox rows, available from ``now`` unless a retry's backoff says later,
    and wake idle workers of their queues (NOTIFY is delivered at commit, and only if
    the transaction commits). One statement, one round trip,
    however many rows and queues: the rows come in as arrays, and one notification
    per distinct queue is raised from the rows actually inserted."""
    if not dispatches:
        return
    conn.execute("""
        WITH ins AS (
            INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at, created_at)
            SELECT q, r, t, a, n, l, COALESCE(av, %(now)s), %(now)s
              FROM unnest(%(q)s::text[], %(r)s::text[], %(t)s::text[], %(a)s::int4[],
                          %(n)s::text[], %(l)s::int4[], %(av)s::timestamptz[]) AS d(q, r, t, a, n, l, av)
            RETURNING queue)
        SELECT pg_notify(%(channel)s, q.queue) FROM (SELECT DISTINCT queue FROM ins ORDER BY queue) q""",
        {"q": [d.queue for d in dispatches],
         "r": [d.run_id for d in dispatches], "t": [d.task_id for d in dispatches],
         "a": [d.attempt for d in dispatches], "n": [d.task_name for d in dispatches],
         "l": [d.lease_s for d in dispatches], "av": [d.available_at for d in dispatches], "now": now,
         "channel": CHANNEL})


def listen(conn: Conn, channel: str = CHANNEL) -> None:
    """Subscribe ``conn`` (an autocommit connection of its own) to ``channel``."""
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


_CLAIM = """
        SELECT run_id, task_id, node_id, attempt, task_name, queue, input, lease_s, lease_owner, lease_expires_at
          FROM composer_claim(%(queues)s, %(names)s::text[], %(owner)s, %(limit)s, %(claim)s)"""


def claim(conn: Conn, queues: Sequence[str], owner: str, limit: int,
          task_names: Sequence[str] | None = None, *, claim_id: str) -> list[Claim]:
    """Claim up to ``limit`` available tasks of ``queues`` for ``owner`` (only tasks
    named in ``task_names`` when given: a worker never takes work it has no handler for),
    recording each in its run's history as claimed by ``claim_id``."""
    return fetch_all(conn, Claim, _CLAIM,
                     {"queues": list(queues), "owner": owner, "limit": limit, "claim": claim_id,
                      "names": list(task_names) if task_names is not None else None})


def claimed_by(conn: Conn, owner: str, claim_id: str) -> list[Claim]:
    """The tasks claim ``claim_id`` took for ``owner`` that ``owner`` still holds: what a
    claim retried after a lost acknowledgement returns instead of claiming again. Reads
    the RUNNING tasks (few, through their partial index) and each one's history."""
    return fetch_all(conn, Claim, """
        SELECT t.run_id, t.id AS task_id, t.node_id, t.attempt, h.detail->>'task' AS task_name,
               COALESCE(t.queue, 'default') AS queue, t.input_json AS input, (h.detail->>'lease_s')::int AS lease_s,
               t.lease_owner, t.lease_expires_at
          FROM task_instances t
          JOIN run_history h ON h.run_id = t.run_id AND h.task_id = t.id AND h.attempt = t.attempt
         WHERE t.state = 'RUNNING' AND t.lease_owner = %(owner)s
           AND h.kind = 'claimed' AND h.request = %(claim)s
         ORDER BY t.run_id, t.id""", {"owner": owner, "claim": claim_id})


def delete_for_tasks(conn: Conn, run_id: str, task_ids: Sequence[str]) -> int:
    """Drop pending dispatches of the given tasks (cancelled tasks); runs before their
    tasks are updated (the lock order above)."""
    if not task_ids:
        return 0
    cur = conn.execute("DELETE FROM task_outbox WHERE run_id = %s AND task_id = ANY(%s)",
                       (run_id, list(task_ids)))
    return cur.rowcount


def delete_for_run(conn: Conn, run_id: str) -> int:
    """Drop every pending dispatch of a run (a deleted run has none left to run)."""
    return conn.execute("DELETE FROM task_outbox WHERE run_id = %s", (run_id,)).rowcount
