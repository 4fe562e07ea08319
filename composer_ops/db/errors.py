"""Translate driver errors into the :mod:`composer_ops.errors` tree, in one place."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import psycopg
from psycopg import errors as pgerr

from composer_ops.errors import ComposerError, Conflict, Invalid, NotFound, Unavailable

P = ParamSpec("P")
T = TypeVar("T")

#: SQLSTATEs a caller may simply retry: serialization failure, deadlock, and the
#: connection-exception class (08xxx), plus admin shutdown / crash recovery.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "55P03"})


def is_transient(exc: BaseException) -> bool:
    """True for database errors that a retry of the whole transaction can cure."""
    if isinstance(exc, psycopg.OperationalError) and not isinstance(exc, pgerr.QueryCanceled):
        state = getattr(exc, "sqlstate", None)
        return state is None or state.startswith("08") or state in TRANSIENT_SQLSTATES
    state = getattr(exc, "sqlstate", None)
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


def translate(exc: psycopg.Error, what: str) -> ComposerError:
    """Map a driver error raised while doing ``what`` to a ComposerError."""
    msg = (exc.diag.message_primary if getattr(exc, "diag", None) else None) or str(exc).strip()
    if isinstance(exc, pgerr.CheckViolation) and "no partition" in msg:
        return Invalid(f"{what}: no partition holds this run ID's month ({msg}); "
                       "run `composer-ops partitions ensure` or use a recent run ID")
    if isinstance(exc, pgerr.UniqueViolation):
        return Conflict(f"{what}: {msg}")
    if isinstance(exc, pgerr.ForeignKeyViolation):
        return NotFound(f"{what}: {msg}")
    if isinstance(exc, (pgerr.DataException, pgerr.IntegrityError)):
        return Invalid(f"{what}: {msg}")
    if isinstance(exc, psycopg.OperationalError):
        return Unavailable(f"{what}: {msg} (the database is unreachable or overloaded; the request can be retried)")
    return ComposerError(f"{what}: {msg}")


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """``with translated("insert run"):`` re-raises driver errors as ComposerErrors."""
    try:
        yield
    except psycopg.Error as exc:
        raise translate(exc, what) from exc


def translating(what: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Decorator form of :func:`translated`, for the public API's boundary: callers
    see ComposerErrors only (a pool timeout or a lost server is :class:`Unavailable`)."""

    def wrap(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return fn(*args, **kwargs)
            except psycopg.Error as exc:
                raise translate(exc, what) from exc

        return inner

    return wrap
