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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeAlias

import polars as pl
import psycopg

from composer_ops.core.model import ACTIVE_TASK_STATES
from composer_ops.core.runids import add_months, month_label
from composer_ops.db import connect
from composer_ops.repo import analytics
from composer_ops.repo.analytics import COORDINATOR_QUEUE
from composer_ops.repo.partitions import RUN_TABLES

Source: TypeAlias = "psycopg.Connection[Any] | str | None"
Schema: TypeAlias = Mapping[str, Any]  # column -> polars dtype

#: Task states that count as active (the engine's list), in a stable order for tables and charts.
ACTIVE_STATES: tuple[str, ...] = tuple(sorted(ACTIVE_TASK_STATES))

__all__ = ["ACTIVE_STATES", "COORDINATOR_QUEUE", "RUN_TABLES", "ReadFrom", "Schema", "Source", "UTC_TS", "add_months",
           "connection", "db_now", "month_label", "read_from", "rows_frame", "snapshot"]

UTC_TS = pl.Datetime("us", "UTC")


@contextlib.contextmanager
def connection(source: Source, *, application_name: str = "composer-ops ops") -> Iterator[psycopg.Connection[Any]]:
    """Yield a connection for ``source``. One opened here runs a single read-only
    REPEATABLE READ transaction (every query sees the same snapshot and the same
    ``now()``, so figures computed by different queries agree) and is closed at the
    end of the block, so a notebook never leaves a session idle in transaction."""
    if isinstance(source, psycopg.Connection):
        yield source
        return
    conn = connect(source, application_name=application_name)
    try:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        yield conn
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
