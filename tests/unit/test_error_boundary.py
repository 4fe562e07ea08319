"""The error boundary without a server: which driver errors become which ComposerError,
and ``db_retry`` retrying exactly the transient ones."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from psycopg import OperationalError
from psycopg import errors as pgerr
from psycopg_pool import PoolClosed, PoolTimeout

from composer_ops.db.errors import translate
from composer_ops.db.retry import db_retry
from composer_ops.errors import ComposerError, Conflict, Invalid, NotFound, PermissionDenied, Transient, Unavailable

TRANSIENT = [
    pgerr.SerializationFailure("could not serialize access due to concurrent update"),
    pgerr.DeadlockDetected("deadlock detected"),
    pgerr.LockNotAvailable("canceling statement due to lock timeout"),
    pgerr.AdminShutdown("terminating connection due to administrator command"),
    pgerr.CrashShutdown("terminating connection because of crash of another server process"),
    pgerr.CannotConnectNow("the database system is starting up"),
    pgerr.ConnectionFailure("connection failure"),
    OperationalError("server closed the connection unexpectedly"),
    PoolTimeout("couldn't get a connection after 0.05 sec"),
]

NOT_TRANSIENT: list[tuple[Exception, type[ComposerError]]] = [
    (pgerr.UniqueViolation("duplicate key value violates unique constraint"), Conflict),
    (pgerr.ForeignKeyViolation("insert or update violates foreign key constraint"), NotFound),
    (pgerr.CheckViolation("no partition of relation \"workflow_runs\" found for row"), Invalid),
    (pgerr.InvalidTextRepresentation("invalid input syntax for type integer"), Invalid),
    (pgerr.QueryCanceled("canceling statement due to statement timeout"), Unavailable),
    (PoolClosed("the pool 'x' is already closed"), ComposerError),
    (pgerr.InsufficientPrivilege("permission denied for table workflow_runs"), PermissionDenied),
    (pgerr.SyntaxError("syntax error at or near \"SELEC\""), ComposerError),
]


@pytest.mark.parametrize("exc", TRANSIENT, ids=lambda e: type(e).__name__)
def test_transient_driver_errors_become_transient(exc: Exception) -> None:
    err = translate(exc)  # type: ignore[arg-type]
    assert isinstance(err, Transient) and isinstance(err, Unavailable)
    assert "\n" not in str(err) and str(exc).splitlines()[0] in str(err)


@pytest.mark.parametrize(("exc", "kind"), NOT_TRANSIENT, ids=lambda v: getattr(type(v), "__name__", ""))
def test_other_driver_errors_keep_their_kind_and_are_not_transient(exc: Exception, kind: type[ComposerError]) -> None:
    err = translate(exc)  # type: ignore[arg-type]
    assert type(err) is kind and not isinstance(err, Transient)
    assert "\n" not in str(err)


def test_a_missing_partition_says_what_to_run() -> None:
    err = translate(pgerr.CheckViolation("no partition of relation \"workflow_runs\" found for row"))
    assert "composer-ops partitions ensure" in str(err)


@pytest.fixture
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr("composer_ops.db.retry.time.sleep", slept.append)
    return slept


def _failing(errors: list[BaseException]) -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []

    @db_retry(max_attempts=4)
    def txn() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "done"

    return calls, txn


@pytest.mark.parametrize("exc", TRANSIENT, ids=lambda e: type(e).__name__)
def test_db_retry_retries_what_the_boundary_calls_transient(exc: Exception, no_sleep: list[float]) -> None:
    translated = translate(exc)  # type: ignore[arg-type]
    calls, txn = _failing([translated, translated])
    assert txn() == "done" and len(calls) == 3
    assert len(no_sleep) == 2 and all(0 <= d <= 2.0 for d in no_sleep)


def test_db_retry_gives_up_after_max_attempts_with_the_last_error(no_sleep: list[float]) -> None:
    errors: list[BaseException] = [Transient(f"lost {i}") for i in range(10)]
    calls, txn = _failing(errors)
    with pytest.raises(Transient, match="lost 3"):
        txn()
    assert len(calls) == 4 and len(no_sleep) == 3


@pytest.mark.parametrize(("exc", "kind"), [*NOT_TRANSIENT, (Unavailable("cannot connect: bad password"), Unavailable),
                                           (ValueError("a bug"), ValueError)],
                         ids=lambda v: getattr(type(v), "__name__", ""))
def test_db_retry_lets_everything_else_through_at_once(exc: Exception, kind: type[Exception],
                                                      no_sleep: list[float]) -> None:
    err = translate(exc) if isinstance(exc, pgerr.Error) else exc
    calls, txn = _failing([err])
    with pytest.raises(kind):
        txn()
    assert len(calls) == 1 and no_sleep == []


def test_raw_driver_errors_are_not_retried(no_sleep: list[float]) -> None:
    """Nothing above the boundary sees driver errors; one that got through anyway is a
    bug to surface, not something to retry."""
    calls, txn = _failing([pgerr.SerializationFailure("raw")])
    with pytest.raises(pgerr.SerializationFailure):
        txn()
    assert len(calls) == 1
