"""Plumbing shared by the ops analytics: where the connection comes from, and how
query results become typed polars DataFrames.

Every public ops function takes ``source``: an open psycopg connection (used as is,
never committed or closed), a libpq URL, or None (``COMPOSER_DATABASE_URL``, else
the embedded server if it is already running: nothing here starts a server, see
:func:`composer_ops.db.find_url`). Connections opened here are read-only sessions:
the analytics never write, and a reader role would refuse it anyway.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeAlias

import polars as pl
import psycopg

from composer_ops.core.model import ACTIVE_TASK_STATES
from composer_ops.core.runids import add_months, month_label
from composer_ops.db import ENV_LOCK_WAIT, connect
from composer_ops.errors import Invalid, LockTimeout
from composer_ops.repo import analytics, locks
from composer_ops.repo.analytics import COORDINATOR_QUEUE
from composer_ops.repo.partitions import RUN_TABLES, set_lock_timeout

Source: TypeAlias = "psycopg.Connection[Any] | str | None"
Schema: TypeAlias = Mapping[str, Any]  # column -> polars dtype

#: Task states that count as active (the engine's list), in a stable order for tables and charts.
ACTIVE_STATES: tuple[str, ...] = tuple(sorted(ACTIVE_TASK_STATES))

__all__ = ["ACTIVE_STATES", "COORDINATOR_QUEUE", "RUN_TABLES", "ReadFrom", "Schema", "Source", "UTC_TS", "add_months",
           "connection", "db_now", "month_label", "read_from", "rows_frame", "snapshot"]

UTC_TS = pl.Datetime("us", "UTC")


#: How long a read of a connection opened here waits for a lock held elsewhere (an
#: operator's drop, a migration's ALTER) before it fails naming the holders:
#: ``COMPOSER_LOCK_WAIT`` seconds (``report`` and ``runbook --lock-wait`` set it for
#: their kernels), this unless set. A report would otherwise wait its whole cell timeout
#: (600 s) and say only that the cell was interrupted.
READ_LOCK_WAIT_S = 30.0


def read_lock_wait_s() -> float:
    """:data:`READ_LOCK_WAIT_S`, or ``COMPOSER_LOCK_WAIT`` when set (``Invalid`` naming it
    when it is not a finite number of seconds above 0), as the CLI's ``--lock-wait`` takes it."""
    raw = os.environ.get(ENV_LOCK_WAIT, "").strip()
    if not raw:
        return READ_LOCK_WAIT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):        # as the CLI's --lock-wait and Engine.connect
        raise Invalid(f"{ENV_LOCK_WAIT} must be a finite number of seconds above 0, got {raw!r}")
    return seconds


@contextlib.contextmanager
def connection(source: Source, *, application_name: str = "composer-ops ops",
               lock_wait_s: float | None = None) -> Iterator[psycopg.Connection[Any]]:
    """Yield a connection for ``source``. One opened here runs a single read-only
    REPEATABLE READ transaction (every query sees the same snapshot and the same
    ``now()``, so figures computed by different queries agree) and is closed at the
    end of the block, so a notebook never leaves a session idle in transaction. Its
    lock waits end after ``lock_wait_s`` (default :func:`read_lock_wait_s`), with a
    :class:`~composer_ops.errors.LockTimeout` naming the sessions holding locks on the
    run tables."""
    if isinstance(source, psycopg.Connection):
        yield source
        return
    wait_s = read_lock_wait_s() if lock_wait_s is None else lock_wait_s
    longer = (f", or wait longer with {ENV_LOCK_WAIT} (report and runbook: --lock-wait)" if lock_wait_s is None
              else "")
    conn = connect(source, application_name=application_name)
    try:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        set_lock_timeout(conn, wait_s)
        try:
            yield conn
        except LockTimeout as exc:
            # Only a read of this connection's (its transaction failed on it): a lock
            # timeout of some other session the block used is its own error, as raised.
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.INERROR:
                raise
            conn.rollback()
            holders = locks.holders_text_on(contextlib.nullcontext(conn), RUN_TABLES)
            raise LockTimeout(f"a read waited {wait_s:g}s for a lock held elsewhere and gave up ({holders}); "
                              f"try again once that transaction ends{longer}") from exc
    finally:
        conn.rollback()
        conn.close()


#: ``with ops.snapshot(database_url) as conn:`` in a notebook: one consistent read.
snapshot = connection


def rows_frame(rows: Sequence[Sequence[Any]], schema: Schema) -> pl.DataFrame:
    """Tuples to a DataFrame with exactly ``schema``'s columns and types (so an empty
    result still has the right shape); timestamps are normalised to UTC whatever the
    session TimeZone."""
    fixed = [tuple(_utc(v) for v in row) for row in rows]
    return pl.DataFrame(fixed, schema=dict(schema), orient="row")


def db_now(conn: psycopg.Connection[Any]) -> datetime:
    """The database clock (now() of the current transaction), in UTC."""
    value = analytics.db_now(conn)
    assert isinstance(value, datetime)
    return value.astimezone(UTC)


@dataclass(frozen=True, kw_only=True)
class ReadFrom:
    """The server a report reads: a primary, or a hot standby and how far behind it is."""

    standby: bool
    last_replay_at: datetime | None = None   # commit time (on the primary) of the last replayed transaction
    replay_lag_s: float | None = None        # 0 when it replayed all the WAL it received
    wal_receiver: str | None = None          # 'streaming' while it follows the primary (see analytics.replication)


def read_from(conn: psycopg.Connection[Any]) -> ReadFrom:
    """Whether ``conn`` reads a hot standby, and its replay lag by its clock."""
    standby, last, lag, receiver = analytics.replication(conn)
    return ReadFrom(standby=bool(standby), last_replay_at=_utc(last), replay_lag_s=lag, wal_receiver=receiver)


def _utc(value: Any) -> Any:
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC)
    return value
