"""Webhook relay: POST the finished run as JSON, at least once.

Deliveries are rows written in the transaction that finished the run. The relay
takes due rows (pushing their next attempt ahead as a lease), POSTs outside any
transaction, then records success or schedules a retry with capped exponential
backoff. A slow or failing endpoint delays only its own deliveries.

Signature: with ``COMPOSER_WEBHOOK_SECRET`` set, ``X-Composer-Signature`` is
``t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">``; receivers recompute it and
reject stale timestamps, which stops replays. The secret is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from composer_ops.repo import webhooks
from composer_ops.repo._base import Conn

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 64 * 1024
SIGNATURE_HEADER = "X-Composer-Signature"


@dataclass(frozen=True, kw_only=True)
class RelayPolicy:
    timeout_s: float = 5.0
    max_attempts: int = 12
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 300.0
    lease_s: float = 60.0
    batch: int = 20


def sign(secret: str, body: bytes, timestamp: int) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: str, body: bytes, header: str, *, now: float | None = None, tolerance_s: float = 300) -> bool:
    """Receiver side: check a signature header and its timestamp's freshness."""
    try:
        parts = dict(item.split("=", 1) for item in header.split(","))
        ts = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((now if now is not None else time.time()) - ts) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, body, ts), header)


def post(url: str, payload: Any, *, secret: str | None, timeout_s: float) -> tuple[int | None, str | None]:
    """POST once; returns (status, error). Only http(s); the response read is capped."""
    if urlsplit(url).scheme not in ("http", "https"):
        return None, f"refusing to POST to a non-http(s) URL {url!r}"
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True, default=str).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "composer-ops webhook"}
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, body, int(time.time()))
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - scheme checked
            response.read(MAX_RESPONSE_BYTES)
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code, f"HTTP {exc.code}"
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, f"{type(exc).__name__}: {reason}"
    if 200 <= status < 300:
        return status, None
    return status, f"HTTP {status}"


def relay_once(pool: Any, *, secret: str | None, policy: RelayPolicy = RelayPolicy()) -> tuple[int, int]:
    """Deliver what is due, the batch's POSTs in parallel so one slow endpoint costs
    the others nothing; returns (delivered, failed attempts)."""
    with pool.connection() as conn, conn.transaction():
        due = webhooks.claim_due(conn, policy.batch, policy.lease_s)
    if not due:
        return 0, 0
    with ThreadPoolExecutor(max_workers=min(8, len(due)), thread_name_prefix="composer-webhook") as posts:
        results = list(posts.map(lambda d: post(d.url, d.payload, secret=secret, timeout_s=policy.timeout_s), due))
    delivered = failed = 0
    with pool.connection() as conn, conn.transaction():
        for item, (status, error) in zip(due, results, strict=True):
            if error is None:
                webhooks.mark_delivered(conn, item.id, status or 200)
                delivered += 1
            else:
                failed += 1
                _record_failure(conn, item.id, item.attempts, status, error, policy)
                log.warning("webhook for run %s failed (attempt %d): %s", item.run_id, item.attempts, error)
    return delivered, failed


def _record_failure(conn: Conn, delivery_id: int, attempts: int, status: int | None, error: str,
                    policy: RelayPolicy) -> None:
    retry_in = None if attempts >= policy.max_attempts else min(
        policy.max_backoff_s, policy.initial_backoff_s * 2 ** (attempts - 1))
    webhooks.mark_failed(conn, delivery_id, status=status, error=error, retry_in_s=retry_in)
