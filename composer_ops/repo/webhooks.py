"""Webhook deliveries: enqueued when a run finishes, relayed at least once."""

from __future__ import annotations

from composer_ops.repo._base import Conn, fetch_all
from composer_ops.repo.rows import WebhookDelivery


def claim_due(conn: Conn, limit: int, lease_s: float) -> list[WebhookDelivery]:
    """Take up to ``limit`` due deliveries and push their next attempt ``lease_s``
    ahead, so another relay does not send them while this one is; if this relay
    dies the delivery is simply tried again after the lease (at least once). In the
    order they were made (by ID): an UPDATE returns its rows in no defined order, and
    the relay starts its POSTs in the order given."""
    return fetch_all(conn, WebhookDelivery, """
        WITH taken AS (
            UPDATE webhook_deliveries d
               SET next_attempt_at = NOW() + make_interval(secs => %s), attempts = d.attempts + 1
              FROM (SELECT id FROM webhook_deliveries
                     WHERE delivered_at IS NULL AND gave_up_at IS NULL AND next_attempt_at <= NOW()
                     ORDER BY next_attempt_at LIMIT %s FOR UPDATE SKIP LOCKED) due
             WHERE d.id = due.id
            RETURNING d.id, d.run_id, d.url, d.payload, d.attempts)
        SELECT id, run_id, url, payload, attempts FROM taken ORDER BY id""", (lease_s, limit))


def mark_delivered(conn: Conn, delivery_id: int, status: int) -> None:
    conn.execute("""UPDATE webhook_deliveries SET delivered_at = NOW(), last_status = %s, last_error = NULL
                     WHERE id = %s""", (status, delivery_id))


def mark_failed(conn: Conn, delivery_id: int, *, status: int | None, error: str, retry_in_s: float | None) -> None:
    """Record a failed attempt; ``retry_in_s=None`` gives up."""
    conn.execute("""
        UPDATE webhook_deliveries
           SET last_status = %s, last_error = %s,
               next_attempt_at = CASE WHEN %s::float8 IS NULL THEN next_attempt_at
                                      ELSE NOW() + make_interval(secs => %s::float8) END,
               gave_up_at = CASE WHEN %s::float8 IS NULL THEN NOW() END
         WHERE id = %s""", (status, error[:2000], retry_in_s, retry_in_s, retry_in_s, delivery_id))


def prune(conn: Conn, keep_s: float, limit: int) -> int:
    """Delete up to ``limit`` deliveries that were delivered or given up more than
    ``keep_s`` seconds ago, oldest first (the partial index on their finish time);
    returns how many. Small batches keep each transaction short."""
    cur = conn.execute("""
        DELETE FROM webhook_deliveries
         WHERE id IN (SELECT id FROM webhook_deliveries
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
