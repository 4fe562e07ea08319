"""Plumbing shared by the ops analytics: where the connection comes from, and how
query results become typed polars DataFrames.

Every public ops function takes ``source``: an open psycopg connection (used as is,
never committed or closed), a libpq URL, or None (``COMPOSER_DATABASE_URL``, else
the embedded server). Connections opened here are read-only sessions: the analytics
never write, and a reader role would refuse it anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeAlias

import polars as pl
import psycopg

from composer_ops.db import connect

Source: TypeAlias = "psycopg.Connection[Any] | str | None"
Schema: TypeAlias = Mapping[str, Any]  # column -> polars dtype

#: Task states that count as active: the partial indexes on task_instances cover these.
ACTIVE_STATES = ("PENDING", "RUNNING", "QUEUED", "WAITING")
#: Same list as SQL, in the order of idx_task_instances_run_active's predicate.
ACTIVE_SQL = "('PENDING', 'RUNNING', 'QUEUED', 'WAITING')"
#: Tables partitioned by month on the run ID, in foreign-key order.
RUN_TABLES = ("workflow_runs", "task_instances", "workflow_events")
#: What queue a non-TASK node (SWITCH, WAIT, WAIT_FOR_EVENT) is listed under.
COORDINATOR_QUEUE = "(coordinator)"

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


def frame(conn: psycopg.Connection[Any], query: str, params: Any, schema: Schema) -> pl.DataFrame:
    """Run ``query`` and return its rows as a DataFrame with exactly ``schema``'s
    columns and types (so an empty result still has the right shape)."""
    with conn.cursor() as cur:
        cur.execute(query.encode(), params)
        rows = cur.fetchall()
    return rows_frame(rows, schema)


def rows_frame(rows: Sequence[Sequence[Any]], schema: Schema) -> pl.DataFrame:
    """Tuples to a DataFrame; timestamps are normalised to UTC whatever the session TimeZone."""
    fixed = [tuple(_utc(v) for v in row) for row in rows]
    return pl.DataFrame(fixed, schema=dict(schema), orient="row")


def scalar(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query.encode(), params).fetchone()
    return None if row is None else row[0]


def db_now(conn: psycopg.Connection[Any]) -> datetime:
    """The database clock (now() of the current transaction), in UTC."""
    value = scalar(conn, "SELECT now()")
    assert isinstance(value, datetime)
    return value.astimezone(UTC)


def _utc(value: Any) -> Any:
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC)
    return value


def month_label(value: datetime) -> str:
    """The partition suffix (YYYYMM) of the UTC month containing ``value``."""
    return value.astimezone(UTC).strftime("%Y%m")


def add_months(month: str, n: int) -> str:
    """``add_months("202612", 2) == "202702"`` (partition suffix arithmetic)."""
    index = int(month[:4]) * 12 + int(month[4:]) - 1 + n
    return f"{index // 12:04d}{index % 12 + 1:02d}"


def month_start(month: str) -> datetime:
    """The first instant (UTC) of the month a partition suffix names."""
    return datetime(int(month[:4]), int(month[4:]), 1, tzinfo=UTC)
