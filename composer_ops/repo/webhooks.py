"""Webhook deliveries: enqueued when a run finishes, relayed at least once."""

from __future__ import annotations

from collections.abc import Sequence

from composer_ops.repo._base import Conn, fetch_all
from composer_ops.repo.rows import DueWebhook, WebhookDelivery


def claim_due(conn: Conn, limit: int, lease_s: float) -> list[WebhookDelivery]:
    """Take up to ``limit`` due deliveries (:func:`due`, then :func:`take`) and push their
    next attempt ``lease_s`` ahead, so another relay does not send them while this one
    is; if this relay dies the delivery is simply tried again after the lease (at least
    once)."""
    return take(conn, due(conn, limit), lease_s)


def due(conn: Conn, limit: int) -> list[DueWebhook]:
    """Up to ``limit`` deliveries due now (the database's NOW()), the longest due first
    (the partial index on ``next_attempt_at``). On Citus this reads every shard; the
    coordinator reads them node by node instead (repo/citus_scan.py)."""
    rows = conn.execute("""
        SELECT run_id, id FROM webhook_deliveries
         WHERE delivered_at IS NULL AND gave_up_at IS NULL AND next_attempt_at <= NOW()
         ORDER BY next_attempt_at LIMIT %s""", (limit,)).fetchall()
    return [DueWebhook(run_id=str(r[0]), id=int(r[1])) for r in rows]


def take(conn: Conn, candidates: Sequence[DueWebhook], lease_s: float) -> list[WebhookDelivery]:
    """Take the ``candidates`` still due and push their next attempt ``lease_s`` ahead.
    A read of due rows and this update are two statements, the same on a single server
    and on Citus (where the deliveries are distributed by run ID and a statement over
    many shards cannot lock rows): the update checks again that each is due, so a relay
    that took one meanwhile (this update waits for the other's to commit, then finds
    the row pushed ahead) skips it."""
    if not candidates:
        return []
    return fetch_all(conn, WebhookDelivery, """
        UPDATE webhook_deliveries d
           SET next_attempt_at = NOW() + make_interval(secs => %(lease)s), attempts = d.attempts + 1
         WHERE d.run_id = ANY(%(runs)s) AND d.id = ANY(%(ids)s)
           AND d.delivered_at IS NULL AND d.gave_up_at IS NULL AND d.next_attempt_at <= NOW()
        RETURNING d.id, d.run_id, d.url, d.payload, d.attempts""",
        {"lease": lease_s, "runs": [c.run_id for c in candidates], "ids": [c.id for c in candidates]})


def mark_delivered(conn: Conn, run_id: str, delivery_id: int, status: int) -> None:
    conn.execute("""UPDATE webhook_deliveries SET delivered_at = NOW(), last_status = %s, last_error = NULL
                     WHERE run_id = %s AND id = %s""", (status, run_id, delivery_id))


def mark_failed(conn: Conn, run_id: str, delivery_id: int, *, status: int | None, error: str,
                retry_in_s: float | None) -> None:
    """Record a failed attempt; ``retry_in_s=None`` gives up."""
    if retry_in_s is None:
        conn.execute("""UPDATE webhook_deliveries SET last_status = %s, last_error = %s, gave_up_at = NOW()
                         WHERE run_id = %s AND id = %s""", (status, error[:2000], run_id, delivery_id))
    else:
        conn.execute("""UPDATE webhook_deliveries
                           SET last_status = %s, last_error = %s, next_attempt_at = NOW() + make_interval(secs => %s)
                         WHERE run_id = %s AND id = %s""", (status, error[:2000], retry_in_s, run_id, delivery_id))


def prune(conn: Conn, keep_s: float, limit: int) -> int:
    """Delete up to ``limit`` deliveries that were delivered or given up more than
    ``keep_s`` seconds ago, oldest first (the partial index on their finish time);
    returns how many. Small batches keep each transaction short."""
    cur = conn.execute("""
        DELETE FROM webhook_deliveries
         WHERE (run_id, id) IN (SELECT run_id, id FROM webhook_deliveries
                       WHERE (delivered_at IS NOT NULL OR gave_up_at IS NOT NULL)
                         AND COALESCE(delivered_at, gave_up_at) < NOW() - make_interval(secs => %s)
                       ORDER BY COALESCE(delivered_at, gave_up_at)
                       LIMIT %s)""", (keep_s, limit))
    return cur.rowcount


def give_up_for_run(conn: Conn, run_id: str, reason: str) -> int:
    """Stop relaying a run's delivery that is still pending (the run was deleted)."""
    cur = conn.execute("""
        UPDATE webhook_deliveries SET gave_up_at = NOW(), last_error = %s
         WHERE run_id = %s AND delivered_at IS NULL AND gave_up_at IS NULL""", (reason, run_id))
    return cur.rowcount
