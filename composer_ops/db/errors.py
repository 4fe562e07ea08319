"""The one boundary where driver errors become ComposerErrors.

Every connection composer_ops opens, pooled or not, is a :class:`TranslatingConnection`, which
overrides psycopg's public API only (connect, cursors, transactions, pipelines, notifies,
session settings, and its cursors' execute, copy, stream and fetches) and re-raises each
driver error as a ComposerError with the driver's error as ``__cause__``; the pool's own
errors are translated too, so no code above ``db`` sees or translates a psycopg error.
:class:`~composer_ops.errors.Transient` marks exactly the errors a retry of the whole
transaction can cure (:func:`is_transient`); ``db_retry`` retries those only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from datetime import datetime
from typing import Any, Self

import psycopg
from psycopg import errors as pgerr
from psycopg.rows import Row
from psycopg_pool import ConnectionPool, PoolClosed

from composer_ops.db import loaders
from composer_ops.errors import (
    ComposerError,
    Conflict,
    Invalid,
    LockTimeout,
    NotDelegated,
    NotFound,
    PermissionDenied,
    StartRefused,
    Transient,
    Unavailable,
)

#: SQLSTATEs a retry of the whole transaction can cure: serialization failure,
#: deadlock, admin shutdown / crash shutdown / cannot connect now, lock timeout.
#: Connection exceptions (class 08) and errors without a SQLSTATE (a lost socket)
#: are transient too, see :func:`is_transient`.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "55P03"})

#: Longest server detail appended to a message (a key, not a whole row).
_DETAIL_MAX = 300


#: How a Citus coordinator reports that its connection to a worker node broke inside a
#: statement: an internal error (XX000) saying so, or carrying libpq's own text from the
#: worker's connection. The coordinator aborts the distributed transaction (before any
#: node commits, or it resolves the prepared ones itself), so the whole transaction can
#: be retried, as for a lost connection of our own.
_REMOTE_CONNECTION_LOST = (
    "failure on connection marked as essential",
    "server closed the connection unexpectedly",
    "SSL SYSCALL error",
    "could not receive data from server",
    "connection not open",
)


def is_transient(exc: BaseException) -> bool:
    """True for driver errors that a retry of the whole transaction can cure."""
    state = getattr(exc, "sqlstate", None)
    if isinstance(exc, psycopg.OperationalError) and not isinstance(exc, pgerr.QueryCanceled):
        return state is None or state.startswith("08") or state in TRANSIENT_SQLSTATES
    if state == "XX000":
        diag = getattr(exc, "diag", None)
        text = (diag.message_primary if diag is not None else None) or str(exc)
        return any(marker in text for marker in _REMOTE_CONNECTION_LOST)
    return state in TRANSIENT_SQLSTATES


#: What libpq reports, with no SQLSTATE, when a connection cannot be made *yet*: the
#: server is down, starting, stopping, recovering or full. Anything else at connect
#: time (authentication, a missing role or database, pg_hba.conf) needs a person.
_CONNECT_NOT_YET = (
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",
    "sorry, too many clients already",
    "remaining connection slots are reserved",
    # a server stopping (or an operator's pg_terminate_backend) ends a session still
    # in its startup; one restarting after a crash of another backend, the same
    "terminating connection due to administrator command",
    "terminating connection because of crash of another server process",
)


def connect_may_succeed_later(exc: BaseException) -> bool:
    """True when a failed *connection attempt* is worth repeating: the server was
    unreachable (no FATAL from it: refused, no socket, timeout, name lookup) or said
    it cannot take connections now. libpq gives connect errors no SQLSTATE, so this
    reads its message; a server with non-English ``lc_messages`` makes its own
    refusals look permanent, which only means failing at once, as without waiting."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    text = str(exc)
    if "FATAL:" not in text:
        return True
    return any(reason in text for reason in _CONNECT_NOT_YET)


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (libpq's messages run over several)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: The SQLSTATE an event's one statement (composer_ops/repo/writes.py) raises when a
#: fenced write matched no row: the event is rolled back, a :class:`Conflict`.
FENCE_MISSED = "CO409"

#: The SQLSTATE a start's one statement raises when the database refuses the start: its
#: message is why, its detail the database clock (:class:`StartRefused`).
START_REFUSED = "CO412"

#: The SQLSTATE of a per-node function of Citus that ran on a node not holding its key's
#: shard (sql/citus/R__node_local.sql): :class:`NotDelegated`.
NOT_DELEGATED = "CO421"


def translate(exc: psycopg.Error) -> ComposerError:
    """The ComposerError for a driver error (the caller raises it ``from exc``)."""
    diag = getattr(exc, "diag", None)
    msg = " ".join(((diag.message_primary if diag is not None else None) or first_line(exc)).split())
    if getattr(exc, "sqlstate", None) == FENCE_MISSED:
        return Conflict(msg)
    if getattr(exc, "sqlstate", None) == NOT_DELEGATED:
        return NotDelegated(msg)
    if getattr(exc, "sqlstate", None) == START_REFUSED and diag is not None and diag.message_detail:
        return StartRefused(msg, datetime.fromisoformat(diag.message_detail))
    if isinstance(exc, pgerr.CheckViolation) and "no partition" in msg:
        return Invalid(f"no partition holds this run ID's month ({msg}); "
                       "run `composer-ops partitions ensure` or use a recent run ID")
    if isinstance(exc, (pgerr.UniqueViolation, pgerr.ForeignKeyViolation)):
        detail = " ".join(((diag.message_detail if diag is not None else None) or "").split())
        text = f"{msg} ({detail[:_DETAIL_MAX]})" if detail else msg
        return Conflict(text) if isinstance(exc, pgerr.UniqueViolation) else NotFound(text)
    if isinstance(exc, (psycopg.DataError, psycopg.IntegrityError)):   # classes 22 and 23: the data
        return Invalid(msg)
    if isinstance(exc, PoolClosed):     # the caller's own close(), which no retry cures
        return ComposerError(f"{msg} (the engine or pool was closed by this process and cannot be used again)")
    if isinstance(exc, pgerr.InsufficientPrivilege):
        # Commands that check first name the role themselves (db/roles.py); any other
        # refusal is the server's, which names the object but not the role it wants.
        return PermissionDenied(f"{msg} (this session's role may not: changing runs, queues and schedules needs "
                                "the engine role composer_ops_engine, partitions and migrations the owner; "
                                "docs/security.md)")
    if isinstance(exc, pgerr.LockNotAvailable):
        return LockTimeout(f"{msg} (a transient database error; the request can be retried)")
    if is_transient(exc):
        return Transient(f"{msg} (a transient database error; the request can be retried)")
    if isinstance(exc, psycopg.OperationalError):
        return Unavailable(f"{msg} (the database is unreachable or overloaded; the request can be retried)")
    return ComposerError(msg)


def connect_error(exc: psycopg.Error) -> Unavailable:
    """The error for a failed connection attempt: :class:`Transient` when it may
    succeed later (:func:`connect_may_succeed_later`), else :class:`Unavailable`."""
    text = f"cannot connect to the database: {first_line(exc)}"
    return Transient(text) if connect_may_succeed_later(exc) else Unavailable(text)


def boundary_error(conn: psycopg.Connection[Any], exc: psycopg.Error) -> ComposerError:
    """The ComposerError for ``exc``, raised by an operation on ``conn``: a connection
    closed by this process (``close()``, a ``with`` block) is a plain ComposerError,
    since no retry can cure it, unlike a session the server or the network ended."""
    if conn.closed and not conn.broken:
        return ComposerError("the connection was closed by this process and cannot be used again")
    return translate(exc)


def _misuse(exc: psycopg.Error) -> bool:
    """True for an error psycopg raises itself, with no SQLSTATE, when a caller reads
    rows it cannot read (no result, a closed cursor): a bug to surface as it is."""
    return exc.sqlstate is None and isinstance(exc, (psycopg.ProgrammingError, psycopg.InterfaceError))


class TranslatingCursor(psycopg.Cursor[Row]):
    """A cursor whose statements, COPY and fetches raise ComposerErrors. Reading rows
    already received raises psycopg's own error for a misuse (:func:`_misuse`)."""

    def execute(self, *args: Any, **kwargs: Any) -> Self:
        try:
            return super().execute(*args, **kwargs)
        except psycopg.Error as exc:
            raise boundary_error(self.connection, exc) from exc

    def executemany(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().executemany(*args, **kwargs)
        except psycopg.Error as exc:
            raise boundary_error(self.connection, exc) from exc

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Row]:
        try:
            yield from super().stream(*args, **kwargs)
        except psycopg.Error as exc:
            raise boundary_error(self.connection, exc) from exc

    @contextlib.contextmanager
    def copy(self, *args: Any, **kwargs: Any) -> Iterator[psycopg.Copy]:
        # The block's writes and reads flush to the server: their errors come out here too.
        try:
            with super().copy(*args, **kwargs) as copy:
                yield copy
        except psycopg.Error as exc:
            raise boundary_error(self.connection, exc) from exc

    def fetchone(self) -> Row | None:
        try:
            return super().fetchone()
        except psycopg.Error as exc:
            if _misuse(exc):
                raise
            raise boundary_error(self.connection, exc) from exc

    def fetchmany(self, size: int = 0) -> list[Row]:
        try:
            return super().fetchmany(size)
        except psycopg.Error as exc:
            if _misuse(exc):
                raise
            raise boundary_error(self.connection, exc) from exc

    def fetchall(self) -> list[Row]:
        try:
            return super().fetchall()
        except psycopg.Error as exc:
            if _misuse(exc):
                raise
            raise boundary_error(self.connection, exc) from exc

    # A generator whichever psycopg.Cursor.__iter__ is (a generator, or the cursor as
    # its own iterator): server-side cursors fetch ``itersize`` rows per round trip.
    def __iter__(self) -> Iterator[Row]:  # type: ignore[override]
        rows = super().__iter__()
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except psycopg.Error as exc:
                if _misuse(exc):
                    raise
                raise boundary_error(self.connection, exc) from exc
            yield row

    def scroll(self, value: int, mode: str = "relative") -> None:
        try:
            super().scroll(value, mode)
        except psycopg.Error as exc:
            if _misuse(exc):
                raise
            raise boundary_error(self.connection, exc) from exc

    def close(self) -> None:
        try:
            super().close()
        except psycopg.Error as exc:
            # A named cursor's CLOSE failed (its session is gone): the server dropped the
            # cursor with the session, so it is closed here too, or collecting it warns.
            psycopg.Cursor.close(self)
            raise boundary_error(self.connection, exc) from exc


class TranslatingClientCursor(TranslatingCursor[Row], psycopg.ClientCursor[Row]):
    """psycopg's client-side binding cursor (``conn.cursor_factory = TranslatingClientCursor``), translating."""


class TranslatingRawCursor(TranslatingCursor[Row], psycopg.RawCursor[Row]):
    """psycopg's cursor for statements with PostgreSQL's own ``$n`` placeholders, sent as
    they are (no conversion at each execute), translating: ``TranslatingRawCursor(conn)``."""


class TranslatingServerCursor(TranslatingCursor[Row], psycopg.ServerCursor[Row]):  # type: ignore[misc]  # __iter__, as above
    """A named (server-side) cursor, translating: ``conn.cursor(name=...)``."""


class TranslatingConnection(psycopg.Connection[Row]):
    """A psycopg connection that raises ComposerErrors (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cursor_factory = TranslatingCursor
        self.server_cursor_factory = TranslatingServerCursor
        loaders.register(self)   # 'infinity' timestamps load: a hand-edited row does not stop a reader

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        try:
            return super().connect(conninfo, **kwargs)
        except psycopg.Error as exc:
            raise connect_error(exc) from exc

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().cursor(*args, **kwargs)
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    def commit(self) -> None:
        try:
            super().commit()
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    def rollback(self) -> None:
        try:
            super().rollback()
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    @contextlib.contextmanager
    def transaction(self, savepoint_name: str | None = None,
                    force_rollback: bool = False) -> Iterator[psycopg.Transaction]:
        # Entering sends BEGIN (or SAVEPOINT), leaving COMMIT: both raise here.
        try:
            with super().transaction(savepoint_name, force_rollback) as tx:
                yield tx
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    @contextlib.contextmanager
    def pipeline(self) -> Iterator[psycopg.Pipeline]:
        # Statements in a pipeline report their errors at a sync: the block's end or sync().
        try:
            with super().pipeline() as pipeline:
                yield pipeline
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    def notifies(self, *, timeout: float | None = None,
                 stop_after: int | None = None) -> Generator[psycopg.Notify, None, None]:
        try:
            yield from super().notifies(timeout=timeout, stop_after=stop_after)
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    def set_autocommit(self, value: bool) -> None:
        try:
            super().set_autocommit(value)
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    def set_isolation_level(self, value: psycopg.IsolationLevel | None) -> None:
        try:
            super().set_isolation_level(value)
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    def set_read_only(self, value: bool | None) -> None:
        try:
            super().set_read_only(value)
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    def set_deferrable(self, value: bool | None) -> None:
        try:
            super().set_deferrable(value)
        except psycopg.Error as exc:
            raise boundary_error(self, exc) from exc

    # The attribute forms of the four settings go through the methods above.
    @property
    def autocommit(self) -> bool:
        return super().autocommit

    @autocommit.setter
    def autocommit(self, value: bool) -> None:
        self.set_autocommit(value)

    @property
    def isolation_level(self) -> psycopg.IsolationLevel | None:
        return super().isolation_level

    @isolation_level.setter
    def isolation_level(self, value: psycopg.IsolationLevel | None) -> None:
        self.set_isolation_level(value)

    @property
    def read_only(self) -> bool | None:
        return super().read_only

    @read_only.setter
    def read_only(self, value: bool | None) -> None:
        self.set_read_only(value)

    @property
    def deferrable(self) -> bool | None:
        return super().deferrable

    @deferrable.setter
    def deferrable(self, value: bool | None) -> None:
        self.set_deferrable(value)


class TranslatingPool(ConnectionPool[TranslatingConnection[Any]]):
    """A pool of :class:`TranslatingConnection`; waiting for a free connection in vain raises
    :class:`Transient` rather than a driver error, asking a closed pool a plain
    :class:`ComposerError`."""

    def getconn(self, timeout: float | None = None) -> TranslatingConnection[Any]:
        try:
            return super().getconn(timeout)
        except psycopg.Error as exc:
            raise translate(exc) from exc
