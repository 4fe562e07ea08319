"""Where the database is, and connections and pools to it.

Both lookups prefer an explicit URL, then ``COMPOSER_DATABASE_URL``. :func:`find_url`
only finds a running server and never starts one (what reading code uses, so a missing
variable is an error rather than a new, empty server); :func:`resolve_url` falls back
to starting or reusing the embedded server (``Engine.connect(url=None)``, migrations).
Every connection made here translates driver errors into ComposerErrors
(:class:`~composer_ops.db.errors.TranslatingConnection`); nothing here commits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from composer_ops.db import embedded
from composer_ops.db.errors import TranslatingConnection, TranslatingPool, first_line
from composer_ops.db.retry import backoff_delay
from composer_ops.errors import Invalid, Transient, Unavailable

ENV_URL = "COMPOSER_DATABASE_URL"
#: How long a reader's or an operator command's lock wait lasts, in seconds (the CLI's
#: ``--lock-wait``; the notebooks' reads, composer_ops/ops/_common.py).
ENV_LOCK_WAIT = "COMPOSER_LOCK_WAIT"
#: The least time a new pool waits for its first connection (:func:`make_pool`).
OPEN_TIMEOUT_S = 10.0
log = logging.getLogger(__name__)


def find_url(url: str | None = None) -> str:
    """The URL of a database that is running: ``url``, else ``COMPOSER_DATABASE_URL``,
    else the embedded server under ``COMPOSER_HOME`` if it is up. Never starts a
    server; with none of these, raises :class:`Unavailable` saying how to name or
    start one. Notebooks and other reading code call this (or :func:`connect`,
    which does)."""
    if url:
        return url
    env = os.environ.get(ENV_URL)
    if env:
        return env
    running = embedded.running_url()
    if running is not None:
        return running
    raise Unavailable(f"no database to read: {ENV_URL} is not set and the embedded server under "
                      f"{embedded.home()} is not running; set {ENV_URL} to a libpq URL, "
                      "or start the embedded server with `composer-ops db up`")


def check_url(url: str, what: str = "the database URL") -> None:
    """Refuse (:class:`Invalid`) a URL libpq cannot parse: a typo in the configuration,
    which no retry cures, unlike a server that is down (:class:`Unavailable`)."""
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        # libpq's reason quotes the text it could not parse, which may be a password: not shown.
        raise Invalid(f"{what} is not a libpq URL (postgresql://user@host:port/dbname) or key=value "
                      "connection string; libpq cannot parse it") from None


def resolve_url(url: str | None = None) -> str:
    """The database URL: ``url``, else ``COMPOSER_DATABASE_URL``, else the embedded
    server, started if it is not running. For the engine and other writers."""
    if url:
        return url
    return os.environ.get(ENV_URL) or embedded.up()


def connect(url: str | None = None, *, application_name: str = "composer-ops", autocommit: bool = False,
            row_dicts: bool = False) -> TranslatingConnection[Any]:
    """One translating connection to the database :func:`find_url` finds (it never
    starts a server); raises :class:`Unavailable` with the reason when there is none
    or it cannot connect."""
    target = find_url(url)
    conn: TranslatingConnection[Any] = TranslatingConnection.connect(
        target, autocommit=autocommit, application_name=application_name,
        row_factory=dict_row if row_dicts else psycopg.rows.tuple_row,
    )
    return conn


def check_connection(conn: psycopg.Connection[Any]) -> None:
    """The pool's check on every connection it hands out, without a round trip when
    nothing suggests the connection died.

    ``ConnectionPool.check_connection`` sends an empty query each time: one more round
    trip per transaction, 3 of a 1-task run's 23. A server that restarted, crashed,
    or terminated the session closes its end of the socket (after an error message),
    which makes the socket readable; an idle pooled session otherwise has nothing to
    read (pool connections never LISTEN). So the full check runs exactly when the
    socket is readable (or cannot be polled), and the pool replaces a connection it
    rejects."""
    try:
        pending = bool(select.select([conn.fileno()], [], [], 0)[0])
    except (OSError, ValueError, psycopg.Error):
        pending = True
    if pending or conn.closed:
        ConnectionPool.check_connection(conn)


@contextlib.contextmanager
def autocommit(conn: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """``conn`` in autocommit for the block, as it was after it (idle; a broken one is
    left as it is): a single statement runs as its own transaction, without BEGIN and
    COMMIT round trips. A pool's connections (:func:`make_pool`) are in autocommit
    already; this is for a connection of :func:`connect`."""
    if conn.autocommit:
        yield conn
        return
    conn.autocommit = True
    try:
        yield conn
    finally:
        if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
            conn.autocommit = False


@contextlib.contextmanager
def sent_transaction(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """A transaction whose BEGIN and COMMIT the block sends itself (:func:`send_commit`),
    pipelined with its statements, on a connection in autocommit (a pool's): so that
    the driver adds no round trip of its own. Leaving the block commits a transaction
    still open; an exception rolls it back."""
    try:
        yield
        if conn.info.transaction_status != TransactionStatus.IDLE:
            send_commit(conn)
    except BaseException:
        if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
            conn.execute("ROLLBACK")
        raise


def send_commit(conn: psycopg.Connection[Any]) -> None:
    """COMMIT, in a :func:`sent_transaction` (queued when ``conn`` is in a pipeline)."""
    conn.execute("COMMIT")


def wait_until_reachable(url: str, *, wait_s: float = 0.0, application_name: str = "composer-ops") -> None:
    """Connect once and disconnect. With ``wait_s`` > 0, a failure that may pass (the
    server down, starting, shutting down or full: :func:`connect_may_succeed_later`)
    is retried with capped, jittered backoff for up to ``wait_s`` seconds, one warning
    per attempt; a permanent one (bad password, no such database) raises at once.
    Raises :class:`Unavailable` with the server's reason."""
    if wait_s < 0:
        raise Invalid(f"the time to wait for the database must be 0 or more seconds, got {wait_s}")
    deadline = time.monotonic() + wait_s
    attempt = 0
    while True:
        try:
            TranslatingConnection.connect(url, connect_timeout=10, application_name=application_name).close()
        except Unavailable as exc:
            left = deadline - time.monotonic()
            if left <= 0 or not isinstance(exc, Transient):
                if wait_s > 0 and left <= 0:
                    raise type(exc)(f"cannot connect to the database (waited {wait_s:g}s): "
                                    f"{first_line(exc.__cause__ or exc)}") from exc.__cause__
                raise
            delay = min(left, backoff_delay(attempt, base=0.1, cap=2.0))
            log.warning("cannot connect to the database yet (%s); trying again in %.1fs, for up to %.0fs more",
                        _reason(exc.__cause__ or exc), delay, left)
            time.sleep(delay)
            attempt += 1
        else:
            if attempt:
                log.warning("connected to the database after %d failed attempts", attempt)
            return


def make_pool(url: str | None = None, *, min_size: int = 1, max_size: int = 8,
              application_name: str = "composer-ops", timeout: float = 30.0,
              wait_s: float = 0.0) -> TranslatingPool:
    """A checked pool of translating connections (:func:`check_connection` drops
    connections a server restart killed), in autocommit: a statement outside
    ``conn.transaction()`` is a transaction of its own, sent without BEGIN or COMMIT
    (one round trip where the driver would add two), and several statements that
    must commit together go in ``conn.transaction()``, whose BEGIN and COMMIT are the
    same in either mode.

    ``wait_s``: how long to wait for a server that is not reachable yet (see
    :func:`wait_until_reachable`); 0 fails at once, as one-shot commands should.
    ``timeout``: how long a caller waits for a pooled connection (the first one, at
    least :data:`OPEN_TIMEOUT_S`)."""
    target = resolve_url(url)
    check_url(target)
    # One direct attempt first: an unreachable server is one clear error now, not
    # ``timeout`` seconds of the pool's reconnect warnings.
    wait_until_reachable(target, wait_s=wait_s, application_name=application_name)
    pool = TranslatingPool(
        target,
        connection_class=TranslatingConnection,
        min_size=min_size,
        max_size=max_size,
        kwargs={"application_name": application_name, "autocommit": True},
        check=check_connection,
        timeout=timeout,
        open=False,
        name=application_name,
    )
    try:
        # The first connection may take longer than a short per-call wait on a loaded
        # host: the server answered wait_until_reachable just now.
        pool.open(wait=True, timeout=max(timeout, OPEN_TIMEOUT_S))
    except Exception as exc:
        pool.close()
        raise Unavailable(f"cannot connect to the database: {first_line(exc)}") from exc
    return pool


def _reason(exc: BaseException) -> str:
    """libpq's reason without its ``connection failed: connection to server ... failed:`` prefix."""
    line = first_line(exc)
    return line.rsplit(" failed: ", 1)[-1].strip() if " failed: " in line else line
