"""Thin wrappers over the composer_* partition functions, and the partition list."""

from __future__ import annotations

from datetime import date, datetime

from composer_ops.repo._base import Conn, fetch_all
from composer_ops.repo.rows import PartitionRow

RUN_TABLES = ("workflow_runs", "task_instances", "workflow_events")


def ensure(conn: Conn, months_ahead: int = 3) -> int:
    """Create this UTC month and ``months_ahead`` more for all three tables; returns
    how many partitions were created."""
    row = conn.execute("SELECT composer_ensure_partitions(%s)", (months_ahead,)).fetchone()
    return int(row[0]) if row else 0


def ensure_from(conn: Conn, first_month: date, months_ahead: int) -> int:
    """Like :func:`ensure`, starting at the month containing ``first_month`` (may be past)."""
    row = conn.execute("SELECT composer_ensure_partitions_from(%s, %s)", (first_month, months_ahead)).fetchone()
    return int(row[0]) if row else 0


def drop(conn: Conn, older_than: datetime) -> list[str]:
    """The seed's retention: drop months entirely before ``older_than`` that have no
    active run; returns the dropped months (YYYYMM)."""
    return [str(r[0]) for r in conn.execute("SELECT composer_drop_partitions(%s)", (older_than,)).fetchall()]


def list_partitions(conn: Conn) -> list[PartitionRow]:
    """Every partition of the three run-scoped tables with its declared bounds."""
    return fetch_all(conn, PartitionRow, """
        SELECT p.relname::text AS table, c.relname::text AS name,
               COALESCE(substring(c.relname FROM '_p(\\d{6})$'), '') AS month,
               COALESCE(substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \\(''([^'']*)''\\)'), '')
                   AS lower_bound,
               COALESCE(substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \\(''([^'']*)''\\)'), '')
                   AS upper_bound
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
          JOIN pg_class p ON p.oid = i.inhparent
         WHERE p.relname = ANY(%s) AND p.relnamespace = c.relnamespace
         ORDER BY month, p.relname""", (list(RUN_TABLES),))
