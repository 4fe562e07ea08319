"""The database clock: the one instant a transaction judges and writes time by.

A transaction reads it once, with :data:`NOW` (or :func:`now`), and passes it to every
later statement that compares or writes a time; an event reads it in its first
statement, with the run lock, so the decision, its rows, history and outbox share one
instant. ``now()`` in each statement would not do on Citus, where a statement routed to
a worker node, or spread over shards, evaluates it there; :data:`NOW` names no table,
so it runs on the coordinator.
"""

from __future__ import annotations

from datetime import datetime

from composer_ops.repo._base import Conn

#: The clock read, as a statement (pipelined by callers that send several at once).
NOW = "SELECT now()"


def now(conn: Conn) -> datetime:
    """``now()`` of the connection's current transaction."""
    row = conn.execute(NOW).fetchone()
    assert row is not None and isinstance(row[0], datetime)
    return row[0]
