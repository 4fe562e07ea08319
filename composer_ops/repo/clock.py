"""The database clock: the one instant a transaction judges and writes time by.

A transaction reads it once, with :data:`NOW` (or :func:`now`), and passes it as a
parameter to every statement after it that compares or writes a time. An event does
so in the first statement of its transaction (:func:`runs.lock_and_load` sends it
before the run lock, in the same round trip), so the machine's decision, the rows it
writes, their history and the outbox all carry one instant; the coordinator's scans
read it once per pass.

Calling ``now()`` in each statement gives the same value on a single server (the
transaction's start), but not on Citus: a statement routed to a worker node evaluates
``now()`` there (that node's clock and its own transaction's start), Citus evaluates
the ``now()`` of an INSERT or UPDATE on the coordinator, and a statement over several
shards evaluates it once per shard. :data:`NOW` names no table, so it always runs where
the client is connected: on the coordinator.
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
