"""Shared plumbing of the repository modules.

Every repository function takes the connection to run on and never commits, so the
caller decides the transaction boundary; functions never log. They run on the
connections of :mod:`composer_ops.db` (``db.connect``, the engine's pool), which
translate driver errors where they are raised, so a refused statement reaches the
caller as a ComposerError (``NotFound``, ``Conflict``, ``Invalid``, ``Unavailable``
or ``Transient``) with the driver's error as ``__cause__``; nothing here catches or
translates driver errors itself. Run-scoped tables are partitioned by run ID, so
every query on them filters on run_id to touch a single partition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

Conn = psycopg.Connection[Any]
R = TypeVar("R")


def sql_states(states: Iterable[StrEnum]) -> str:
    """A set of states (``core.model``'s) as an SQL list literal, in declaration order:
    ``sql_states(ACTIVE_TASK_STATES) == "('PENDING', 'QUEUED', 'RUNNING', 'WAITING')"``.
    A literal rather than a parameter, so the planner can match the predicate of a
    partial index even in a generic plan; the values are enum members, never input."""
    chosen = set(states)
    if not chosen:
        raise ValueError("an empty set of states matches nothing")
    members = [m for m in type(next(iter(chosen))) if m in chosen]
    return "(" + ", ".join(f"'{m.value}'" for m in members) + ")"


def jsonb(value: Any) -> Jsonb | None:
    """A JSON parameter; Python None is SQL NULL, not the JSON ``null``."""
    return None if value is None else Jsonb(value)


def recordset(rows: Sequence[Mapping[str, Any]]) -> Jsonb:
    """Rows for ``jsonb_to_recordset(%s::jsonb) AS r(...)``: one JSON array of objects,
    a key left out where its value is None, so that the column is SQL NULL whatever its
    type. A timestamp goes in as :func:`iso` text, which a ``timestamptz`` column reads
    back exactly."""
    return Jsonb([{k: v for k, v in row.items() if v is not None} for row in rows])


def iso(value: datetime | None) -> str | None:
    """``value`` as ISO 8601 text for :func:`recordset` (an aware datetime keeps its offset)."""
    return None if value is None else value.isoformat()


def error_doc(reason: str | None) -> dict[str, str] | None:
    """The error document stored with a failed task or run: ``{"error": reason}``, None
    when there is no reason."""
    return None if not reason else {"error": reason}


def error_json(reason: str | None) -> Jsonb | None:
    """:func:`error_doc` as a JSON parameter."""
    doc = error_doc(reason)
    return None if doc is None else Jsonb(doc)


def fetch_one(conn: Conn, row: type[R], query: str, params: Any) -> R | None:
    with conn.cursor(row_factory=class_row(row)) as cur:
        cur.execute(query, params)
        return cur.fetchone()


def fetch_all(conn: Conn, row: type[R], query: str, params: Any, *, prepare: bool | None = None) -> list[R]:
    """Every row of ``query``; ``prepare=False`` sends it unprepared every time, so the
    server plans it for its values at every call (psycopg otherwise prepares a query
    from its fifth execution on, and the server may then settle on a generic plan)."""
    with conn.cursor(row_factory=class_row(row)) as cur:
        cur.execute(query, params, prepare=prepare)
        return cur.fetchall()



def repeatable_read(conn: Conn, *, read_only: bool = False) -> None:
    """Make the transaction just begun on ``conn`` one REPEATABLE READ snapshot (and
    read-only when asked): every statement of it sees the same rows and ``now()``."""
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY" if read_only
                  else "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")


def set_read_timeouts(conn: Conn, *, lock_s: float, statement_s: float) -> None:
    """Until the end of the caller's transaction, a statement that waits for a lock longer
    than ``lock_s`` (lock_not_available: :class:`~composer_ops.errors.LockTimeout`) or runs
    longer than ``statement_s`` (query_canceled) fails: a reader run from cron fails in its
    time rather than queue behind an operator's lock and stack up with the next runs."""
    conn.execute("SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', %s, true)",
                 (f"{max(1, round(lock_s * 1000))}ms", f"{max(1, round(statement_s * 1000))}ms"))
