"""Webhook relay: POST the finished run as JSON, at least once.

Deliveries are rows written in the transaction that finished the run. The relay leases
due rows, POSTs outside any transaction and records each POST as it ends, retrying with
capped backoff, so a slow endpoint delays only its own deliveries. Each POST is bounded
(connect and read timeouts, a deadline, a response size cap, no redirects) and its URL
checked again. With ``COMPOSER_WEBHOOK_SECRET``, ``X-Composer-Signature`` is
``t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`` (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from composer_ops.core.spec import CREDENTIALS_REFUSED, refused_address
from composer_ops.db.retry import db_retry
from composer_ops.engine.attempt import describe
from composer_ops.errors import Invalid
from composer_ops.repo import webhooks
from composer_ops.repo._base import Conn
from composer_ops.repo.rows import DueWebhook, WebhookDelivery

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 64 * 1024
SIGNATURE_HEADER = "X-Composer-Signature"
#: POSTs of one batch run in parallel, this many at a time.
PARALLEL_POSTS = 8
_ENV = {"connect_timeout_s": "COMPOSER_WEBHOOK_CONNECT_TIMEOUT_S", "timeout_s": "COMPOSER_WEBHOOK_TIMEOUT_S",
        "deadline_s": "COMPOSER_WEBHOOK_DEADLINE_S"}


@dataclass(frozen=True, kw_only=True)
class RelayPolicy:
    """Timeouts (seconds), retries and batching of the relay.

    ``timeout_s`` bounds each read of the response, ``deadline_s`` the whole POST.
    ``lease_s`` (how long a claimed delivery is hidden from other relays) defaults
    to what one batch can take at most, so a relay that dies mid-batch delays its
    deliveries by no more than that.
    """

    connect_timeout_s: float = 3.0
    timeout_s: float = 5.0
    deadline_s: float = 10.0
    max_response_bytes: int = MAX_RESPONSE_BYTES
    max_attempts: int = 12
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 300.0
    lease_s: float | None = None
    batch: int = 20

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "timeout_s", "deadline_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise Invalid(f"webhook {name} must be a positive number of seconds, got {value!r}")
        if self.batch < 1 or self.max_attempts < 1 or self.max_response_bytes < 0:
            raise Invalid("webhook batch and max_attempts must be at least 1, max_response_bytes at least 0")

    @property
    def lease(self) -> float:
        if self.lease_s is not None:
            return self.lease_s
        rounds = math.ceil(self.batch / PARALLEL_POSTS)
        return rounds * (self.deadline_s + self.connect_timeout_s) + 2.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RelayPolicy:
        """Defaults, with the timeouts overridden by ``COMPOSER_WEBHOOK_CONNECT_TIMEOUT_S``,
        ``COMPOSER_WEBHOOK_TIMEOUT_S`` (read) and ``COMPOSER_WEBHOOK_DEADLINE_S``."""
        source = os.environ if env is None else env
        values: dict[str, float] = {}
        for field_name, var in _ENV.items():
            text = source.get(var)
            if text:
                try:
                    values[field_name] = float(text)
                except ValueError:
                    raise Invalid(f"{var}={text!r} is not a number of seconds") from None
        defaults = cls()
        return cls(connect_timeout_s=values.get("connect_timeout_s", defaults.connect_timeout_s),
                   timeout_s=values.get("timeout_s", defaults.timeout_s),
                   deadline_s=values.get("deadline_s", defaults.deadline_s))


@dataclass(frozen=True)
class PostResult:
    """How one POST ended; ``permanent`` when no retry can help (a bad URL)."""

    status: int | None
    error: str | None = None
    permanent: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


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


def url_problem(url: object) -> str | None:
    """Why ``url`` is not a webhook target, or None. Never echoes credentials."""
    if not isinstance(url, str) or not url:
        return "webhook URL is empty or not a string"
    if any(ord(c) <= 32 or ord(c) == 127 for c in url):
        return "webhook URL contains whitespace or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        return f"webhook URL is malformed ({exc})"
    if parts.username is not None or parts.password is not None:
        return CREDENTIALS_REFUSED
    if parts.scheme not in ("http", "https"):
        return f"webhook URL scheme {parts.scheme or '(none)'!r} refused: only http and https"
    if not parts.hostname:
        return "webhook URL has no host"
    return None


def post(url: str, payload: Any, *, secret: str | None, policy: RelayPolicy = RelayPolicy()) -> PostResult:
    """POST once, within the policy's timeouts and deadline; never raises."""
    problem = url_problem(url)
    if problem is not None:
        return PostResult(None, problem, permanent=True)
    parts = urlsplit(url)
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True, default=str).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "composer-ops webhook",
               "Content-Length": str(len(body)), "Connection": "close"}
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, body, int(time.time()))
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = _addresses(parts.hostname or "", port)
    except _Refused as exc:
        return PostResult(None, str(exc), permanent=True)
    except (UnicodeError, ValueError) as exc:      # a name no resolver takes (a label over 63 characters)
        return PostResult(None, f"webhook host is not a valid name ({describe(exc)})", permanent=True)
    except OSError as exc:
        return PostResult(None, f"webhook host {parts.hostname} could not be resolved ({describe(exc)})")
    factory = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = factory(parts.hostname or "", port, timeout=policy.connect_timeout_s)
    # The connection goes to the addresses checked, each in turn as the resolver gave them,
    # not to a second lookup of the host (which could answer otherwise); TLS still checks
    # the certificate against the host's name.
    conn._create_connection = (  # type: ignore[attr-defined]
        lambda where, timeout, source: _connect_first(addresses, where[1], timeout, source))
    expired = threading.Event()
    sockets: list[socket.socket] = []
    watchdog = threading.Timer(policy.deadline_s, _abort, (sockets, expired))
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(policy.timeout_s)
            # The response keeps reading from this socket after http.client drops
            # conn.sock (Connection: close), so the watchdog holds its own reference.
            sockets.append(conn.sock)
        conn.request("POST", target, body=body, headers=headers)
        response = conn.getresponse()
        status = int(response.status)
        _read_capped(response, policy.max_response_bytes)
    except Exception as exc:  # socket, TLS, protocol or encoding errors: all are a failed attempt
        if expired.is_set():
            return PostResult(None, f"no complete response within the {policy.deadline_s:g}s deadline")
        return PostResult(None, describe(exc))
    finally:
        watchdog.cancel()
        conn.close()
    if 200 <= status < 300:
        return PostResult(status)
    if 300 <= status < 400:
        return PostResult(status, f"HTTP {status} (redirects are not followed)")
    return PostResult(status, f"HTTP {status}")


class _Refused(Exception):
    """A webhook host that resolves to an address no webhook is sent to."""


def _addresses(host: str, port: int) -> list[str]:
    """The addresses to connect to for ``host``, in the resolver's order, once every one of
    them is one a webhook may reach (:func:`refused_address`); :class:`_Refused` otherwise."""
    found = list(dict.fromkeys(str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))
    for address in found:
        problem = refused_address(address)
        if problem is not None:
            raise _Refused(problem + (f" ({host} resolves to it)" if host != address.split("%")[0] else ""))
    if not found:
        raise OSError(f"no address for {host}")
    return found


def _connect_first(addresses: Sequence[str], port: int, timeout: float | None,
                   source: tuple[str, int] | None) -> socket.socket:
    """A connection to the first of ``addresses`` that takes one (as
    ``socket.create_connection`` tries a name's addresses); the last error otherwise."""
    last: OSError | None = None
    for address in addresses:
        try:
            return socket.create_connection((address, port), timeout, source)
        except OSError as exc:
            last = exc
    raise last if last is not None else OSError("no address to connect to")


def _read_capped(response: http.client.HTTPResponse, limit: int) -> None:
    """Read at most ``limit`` bytes of the body; the deadline still applies. A body
    cut short after a status line is not an error: the status is the answer."""
    left = limit
    try:
        while left > 0:
            chunk = response.read(min(left, 16384))
            if not chunk:
                return
            left -= len(chunk)
    except (OSError, http.client.HTTPException):
        return


def _abort(sockets: list[socket.socket], expired: threading.Event) -> None:
    expired.set()
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)   # wakes a blocked recv in the POSTing thread
        except OSError:
            pass


def relay_once(pool: Any, *, secret: str | None, policy: RelayPolicy = RelayPolicy(),
               due: Sequence[DueWebhook] | None = None) -> tuple[int, int]:
    """Deliver what is due, the batch's POSTs in parallel so one slow endpoint costs
    the others nothing; returns (delivered, failed attempts). ``due``: the candidates,
    read by the caller (the coordinator's node scans on Citus), of which those still due
    are taken; None: read here (:func:`composer_ops.repo.webhooks.due`).

    Taking the batch is one transaction, and so is recording each group of POSTs that
    ended together (the relay records as POSTs end, not once the whole batch has), each
    retried on a lost connection: a claim whose acknowledgement was lost has pushed its
    rows a lease ahead, so its retry takes none of them again (they are POSTed once,
    after the lease); recording is idempotent, so a retried record does not send them
    again. A POST is repeated only when the relay dies between it and its record, so a
    relay killed mid-batch repeats at most the POSTs in flight or just ended, not every
    POST of the batch that ended before the slowest one."""
    taken = _claim(pool, policy, due)
    if not taken:
        return 0, 0
    delivered = failed = 0
    with ThreadPoolExecutor(max_workers=min(PARALLEL_POSTS, len(taken)),
                            thread_name_prefix="composer-webhook") as posts:
        pending = {posts.submit(post, d.url, d.payload, secret=secret, policy=policy): d for d in taken}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                ended = [(pending.pop(f), _outcome(f)) for f in done]
                _record(pool, ended, policy)
                for item, result in ended:
                    if result.error is None:
                        delivered += 1
                        continue
                    failed += 1
                    log.warning("webhook for run %s failed (attempt %d%s): %s", item.run_id, item.attempts,
                                ", giving up" if result.permanent else "", result.error)
        except BaseException:
            # Recording failed (the database stayed away past the retries): the POSTs not
            # started yet are not sent now, only after the lease, with the rest.
            posts.shutdown(wait=False, cancel_futures=True)
            raise
    return delivered, failed


def _outcome(future: Future[PostResult]) -> PostResult:
    """The POST's result; a POST whose thread failed (``post`` itself never raises) is a
    failed attempt, so the rest of its group is still recorded."""
    try:
        return future.result()
    except Exception as exc:
        return PostResult(None, describe(exc))


@db_retry()
def _claim(pool: Any, policy: RelayPolicy, due: Sequence[DueWebhook] | None) -> list[WebhookDelivery]:
    if due is not None and not due:
        return []
    with pool.connection() as conn, conn.transaction():
        taken = (webhooks.claim_due(conn, policy.batch, policy.lease) if due is None
                 else webhooks.take(conn, due[:policy.batch], policy.lease))
        return sorted(taken, key=lambda d: d.id)


@db_retry()
def _record(pool: Any, ended: list[tuple[WebhookDelivery, PostResult]], policy: RelayPolicy) -> None:
    with pool.connection() as conn, conn.transaction():
        for item, result in ended:
            if result.error is None:
                webhooks.mark_delivered(conn, item.run_id, item.id, result.status or 200)
            else:
                _record_failure(conn, item.run_id, item.id, item.attempts, result, policy)


def _record_failure(conn: Conn, run_id: str, delivery_id: int, attempts: int, result: PostResult,
                    policy: RelayPolicy) -> None:
    retry_in = None if result.permanent or attempts >= policy.max_attempts else min(
        policy.max_backoff_s, policy.initial_backoff_s * 2 ** (attempts - 1))
    webhooks.mark_failed(conn, run_id, delivery_id, status=result.status, error=result.error or "failed",
                         retry_in_s=retry_in)
