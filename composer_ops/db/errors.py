"""The one boundary where driver errors become ComposerErrors.

Every connection composer_ops opens is a :class:`Connection` (``db.connect``, and
the pools of ``db.make_pool`` use it too). psycopg sends every round trip to the
server through ``Connection.wait``: statements, fetches in pipeline mode, COMMIT and
ROLLBACK (including the COMMIT at the end of a ``conn.transaction()`` block),
``notifies()``, session settings such as ``autocommit``. That one method re-raises
driver errors as ComposerErrors, keeping the driver's error as ``__cause__``. The
"connection is closed" check psycopg makes before a round trip, connection attempts
and the pool's own errors (no connection free within the timeout, a closed pool) are
translated the same way, so code above the ``db`` package never sees a psycopg error
and never translates one.

``wait`` and ``_check_connection_ok`` are psycopg internals, not documented API:
pyproject.toml pins the minor series they were checked on, importing this module fails
at once if they (or ``errors._WaitTimeout``) are missing, and
tests/unit/test_driver_internals.py plus tests/integration/test_error_boundary.py
check their signatures and every path above.

Errors psycopg raises in Python for misuse of its API, without a round trip (fetching
from a statement that returned no rows, ``fileno()`` of a closed connection), are bugs
of the caller and are left as they are.

:class:`~composer_ops.errors.Transient` marks exactly the errors a retry of the whole
transaction can cure (:func:`is_transient`); ``db_retry`` retries those and nothing
else.
"""

from __future__ import annotations

from typing import Any, Self, TypeVar

import psycopg
from psycopg import errors as pgerr
from psycopg.abc import PQGen
from psycopg.rows import Row
from psycopg_pool import ConnectionPool, PoolClosed

from composer_ops.errors import (
    ComposerError,
    Conflict,
    Invalid,
    LockTimeout,
    NotFound,
    PermissionDenied,
    Transient,
    Unavailable,
)

RV = TypeVar("RV")

#: SQLSTATEs a retry of the whole transaction can cure: serialization failure,
#: deadlock, admin shutdown / crash shutdown / cannot connect now, lock timeout.
#: Connection exceptions (class 08) and errors without a SQLSTATE (a lost socket)
#: are transient too, see :func:`is_transient`.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "55P03"})

#: Longest server detail appended to a message (a key, not a whole row).
_DETAIL_MAX = 300


def _wait_timeout() -> type[psycopg.Error]:
    """psycopg's internal "a wait with a timeout ran out" error, which ``notifies()``
    catches inside ``Connection.wait``'s caller and so must pass through the boundary
    untranslated; ImportError, naming the versions that work, when psycopg lacks it or
    the methods :class:`Connection` overrides."""
    found = getattr(pgerr, "_WaitTimeout", None)
    methods = all(callable(getattr(psycopg.Connection, name, None)) for name in ("wait", "_check_connection_ok"))
    if not (isinstance(found, type) and issubclass(found, psycopg.Error) and methods):
        raise ImportError(f"composer_ops needs psycopg >=3.3.6,<3.4 (its error boundary overrides "
                          f"Connection.wait and Connection._check_connection_ok); this is psycopg "
                          f"{psycopg.__version__}")
    return found


_WAIT_TIMEOUT = _wait_timeout()


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


def translate(exc: psycopg.Error) -> ComposerError:
    """The ComposerError for a driver error (the caller raises it ``from exc``)."""
    diag = getattr(exc, "diag", None)
    msg = " ".join(((diag.message_primary if diag is not None else None) or first_line(exc)).split())
    if isinstance(exc, pgerr.CheckViolation) and "no partition" in msg:
        return Invalid(f"no partition holds this run ID's month ({msg}); "
                       "run `composer-ops partitions ensure` or use a recent run ID")
    if isinstance(exc, (pgerr.UniqueViolation, pgerr.ForeignKeyViolation)):
        detail = " ".join(((diag.message_detail if diag is not None else None) or "").split())
        text = f"{msg} ({detail[:_DETAIL_MAX]})" if detail else msg
        return Conflict(text) if isinstance(exc, pgerr.UniqueViolation) else NotFound(text)
    if isinstance(exc, (psycopg.DataError, psycopg.IntegrityError)):   # classes 22 and 23: the data
        return Invalid(msg)
    if isinstance(exc, PoolClosed):
        return Unavailable(f"{msg} (the engine or pool was closed)")
    if isinstance(exc, pgerr.InsufficientPrivilege):
        return PermissionDenied(msg)
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


class Connection(psycopg.Connection[Row]):
    """A psycopg connection that raises ComposerErrors (see the module's docstring)."""

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        try:
            return super().connect(conninfo, **kwargs)
        except psycopg.Error as exc:
            raise connect_error(exc) from exc

    def wait(self, gen: PQGen[RV], *args: Any, **kwargs: Any) -> RV:
        try:
            return super().wait(gen, *args, **kwargs)
        except _WAIT_TIMEOUT:
            raise   # psycopg's own signal that a wait with a timeout ran out (notifies() catches it)
        except psycopg.Error as exc:
            raise translate(exc) from exc

    def _check_connection_ok(self) -> None:
        try:
            super()._check_connection_ok()
        except psycopg.Error as exc:
            if self.closed and not self.broken:
                # Closed by this process (close(), a with block): no retry can cure
                # that, unlike a session the server or the network ended.
                raise ComposerError("the connection was closed by this process and cannot be used again"
                                    ) from exc
            raise translate(exc) from exc


class Pool(ConnectionPool[Connection[Any]]):
    """A pool of :class:`Connection`; waiting for a free connection in vain (or asking
    a closed pool) raises :class:`Transient` rather than a driver error."""

    def getconn(self, timeout: float | None = None) -> Connection[Any]:
        try:
            return super().getconn(timeout)
        except psycopg.Error as exc:
            raise translate(exc) from exc
