"""Who holds the locks a statement waited for: the sessions named when a lock wait gives up."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from composer_ops.errors import ComposerError
from composer_ops.repo._base import Conn
from composer_ops.repo.partitions import set_lock_timeout

#: How long a lookup of the holders waits for a lock of its own. It reads catalog views
#: only, whose locks a session may hold all the same (``LOCK pg_locks``, a catalog's
#: VACUUM FULL): the lookup is given up, rather than keep a call that already gave up on
#: its own lock waiting for ever on the lookup.
LOOKUP_LOCK_WAIT_S = 0.5

#: The other sessions holding locks on this database's tables (on ``tables`` and their
#: partitions, when given; with ``lockers``, only locks that can block a row lock, not a
#: plain reader's ACCESS SHARE), oldest transaction first (a role that may not see
#: another's xact_start sees its pid, role and program only).
_HOLDERS = """
    SELECT a.pid, a.usename::text, a.application_name, a.state,
           extract(epoch FROM now() - a.xact_start)::float8,
           string_agg(DISTINCT c.relname::text, ', ' ORDER BY c.relname::text)
      FROM pg_locks l
      JOIN pg_stat_activity a ON a.pid = l.pid
      JOIN pg_class c ON c.oid = l.relation AND c.relkind IN ('r', 'p')
     WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid()
       AND (NOT %(lockers)s OR l.mode <> 'AccessShareLock')
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND (%(tables)s::text[] IS NULL OR c.relname = ANY(%(tables)s::text[])
            OR pg_partition_root(c.oid)::text = ANY(%(tables)s::text[]))
     GROUP BY 1, 2, 3, 4, 5
     ORDER BY 5 DESC NULLS LAST, 1
     LIMIT 3"""

#: The session whose transaction locked a run's row: the row's xmax is the locker's
#: transaction ID, or its subtransaction's when it locked inside a savepoint (a multixact
#: ID when several share the lock, matching no session); every transaction and
#: subtransaction holds an exclusive lock on its own ID, which names its session.
_RUN_LOCKER = """
    SELECT a.pid, a.usename::text, a.application_name, a.state,
           extract(epoch FROM now() - a.xact_start)::float8, NULL::text
      FROM workflow_runs r
      JOIN pg_locks l ON l.locktype = 'transactionid' AND l.transactionid = r.xmax
                     AND l.mode = 'ExclusiveLock' AND l.granted
      JOIN pg_stat_activity a ON a.pid = l.pid
     WHERE r.id = %(run)s AND r.xmax <> '0'::xid AND a.pid <> pg_backend_pid()"""


def lock_holders(conn: Conn, tables: Sequence[str] | None = None, *,
                 lockers: bool = False) -> list[tuple[Any, ...]]:
    """The (at most 3) other sessions holding locks on ``tables`` (or on any table)
    longest: pid, role, program, state, transaction age in seconds, tables.
    ``lockers``: only those whose locks can block a row lock (not plain readers)."""
    return conn.execute(_HOLDERS, {"tables": list(tables) if tables is not None else None,
                                   "lockers": lockers}).fetchall()


def run_locker(conn: Conn, run_id: str) -> list[tuple[Any, ...]]:
    """The session holding the run's row lock, as :func:`lock_holders` rows; none when
    it cannot be told (no lock, or one shared by several sessions)."""
    return conn.execute(_RUN_LOCKER, {"run": run_id}).fetchall()


def holders_text(conn: Conn, tables: Sequence[str] | None = None) -> str:
    """:func:`lock_holders` in one line: "locks held by pid ... holds ...", or that no
    session holds one now."""
    rows = lock_holders(conn, tables)
    return "locks held by " + describe(rows) if rows else "no other session holds a lock on them now"


def holders_text_on(opened: AbstractContextManager[Conn], tables: Sequence[str] | None = None) -> str:
    """:func:`holders_text` on the connection ``opened`` yields (its own, or the caller's
    idle one), in a transaction whose lock waits end after :data:`LOOKUP_LOCK_WAIT_S`;
    when the lookup fails, only that a long transaction holds them."""
    try:
        with opened as conn, conn.transaction():
            set_lock_timeout(conn, LOOKUP_LOCK_WAIT_S)
            return holders_text(conn, tables)
    except ComposerError:
        return "a long transaction holds them"


def describe(rows: Sequence[tuple[Any, ...]]) -> str:
    """Rows of :func:`lock_holders` (or :func:`run_locker`, whose tables are NULL) in one
    line: each pid with its role, program, state, transaction age and tables."""
    held = []
    for pid, role, program, state, age, tables in rows:
        since = f", in a transaction for {age:.0f}s" if age is not None else ""
        held.append(f"pid {pid} ({role}{f', {program}' if program else ''}{f', {state}' if state else ''}{since})"
                    + (f" holds {tables}" if tables else ""))
    return "; ".join(held)
