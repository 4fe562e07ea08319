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

from typing import Any, TypeVar

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

Conn = psycopg.Connection[Any]
R = TypeVar("R")


def jsonb(value: Any) -> Jsonb | None:
    """A JSON parameter; Python None is SQL NULL (the seed's ``nullJSON``)."""
    return None if value is None else Jsonb(value)


def error_json(reason: str | None) -> Jsonb | None:
    """The seed's error document: ``{"error": reason}``."""
    return None if not reason else Jsonb({"error": reason})


def fetch_one(conn: Conn, row: type[R], query: str, params: Any) -> R | None:
    with conn.cursor(row_factory=class_row(row)) as cur:
        cur.execute(query, params)
        return cur.fetchone()


def fetch_all(conn: Conn, row: type[R], query: str, params: Any) -> list[R]:
    with conn.cursor(row_factory=class_row(row)) as cur:
        cur.execute(query, params)
        return cur.fetchall()

