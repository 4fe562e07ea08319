"""The simulator's statements: the history backfill's bulk COPY, and the reads of the
live driver and of the summary (``composer_ops.simulate``, ``composer-ops simulate``).

:func:`copy_rows` is the package's only COPY path. The engine writes runs one event
at a time through the other repository modules; the backfill writes months of
finished history at once, as COPY text built by ``composer_ops.simulate.copytext``.

The reads filter on ``run_id = ANY(...)`` (or ``id``) so they touch only the
partitions of the runs asked about; the overview per month is the one that counts
every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from psycopg import sql

from composer_ops.errors import ComposerError, PermissionDenied
from composer_ops.repo import partitions
from composer_ops.repo._base import Conn

__all__ = ["analyze_month", "check_references", "clock", "copy_rows", "existing_runs", "finished_runs",
           "live_counts", "may_skip_row_triggers", "moved_attempts", "running_tasks", "runs_per_month",
           "signal_counts", "waiting_signals"]

#: Tables whose rows reference a run: copied without their row triggers when allowed.
_REFERENCING = frozenset({"task_instances", "workflow_events"})


def clock(conn: Conn) -> datetime:
    """The database clock (``now()``)."""
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


# -- the backfill ---------------------------------------------------------------------


def existing_runs(conn: Conn, run_ids: Sequence[str]) -> set[str]:
    """Those of ``run_ids`` that are in ``workflow_runs``."""
    rows = conn.execute("SELECT id FROM workflow_runs WHERE id = ANY(%s)", (list(run_ids),)).fetchall()
    return {str(r[0]) for r in rows}


def may_skip_row_triggers(conn: Conn) -> bool:
    """Whether this session may set ``session_replication_role`` (a superuser, or a
    role granted SET on it). Leaves the connection idle, outside any transaction."""
    try:
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
    except PermissionDenied:
        return False
    finally:
        conn.rollback()
    return True


def copy_rows(conn: Conn, table: str, columns: Sequence[str], lines: Sequence[str], *, month: str,
              skip_row_triggers: bool) -> None:
    """COPY ``lines`` (COPY text, one row each, all of run month ``month``) into
    ``table``, in the caller's transaction.

    With ``skip_row_triggers``, rows of the tables that reference a run are copied
    with their row triggers off (as ``pg_restore --disable-triggers`` loads): the
    trigger that checks each row's foreign key costs one lookup query per row, about
    two thirds of the server's time. Their foreign key is then checked for the
    whole batch by :func:`check_references`, which raises (the caller rolls back)
    on an orphan. Runs have no foreign key to their definition since V019."""
    skip = skip_row_triggers and table in _REFERENCING
    with conn.cursor() as cur:
        if skip:
            cur.execute("SET LOCAL session_replication_role = replica")
        with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(
                sql.Identifier(table), sql.SQL(", ").join(map(sql.Identifier, columns)))) as copy:
            copy.write("".join(lines))
        if skip:
            cur.execute("SET LOCAL session_replication_role = origin")
    if skip:
        check_references(conn, table, month, lines)


def check_references(conn: Conn, table: str, month: str, lines: Sequence[str]) -> None:
    """The foreign key of rows just copied without their triggers, checked in bulk:
    every run ID they reference (their second column) must be a run of the month.
    One query probing the runs' primary key once per distinct run. The month's
    partitions are locked by the caller's inserts, so no run can be dropped between
    this check and the commit."""
    referenced = sorted({line.split("\t", 2)[1] for line in lines})
    # Counting the runs found, rather than the IDs without one (a correlated subquery
    # over unnest()), is a statement Citus runs as well: on a distributed month it reads
    # each shard's primary key for the IDs that hash to it.
    row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE id = ANY(%s)").format(
        sql.Identifier(f"workflow_runs_p{month}")), (referenced,)).fetchone()
    missing = len(referenced) - (int(row[0]) if row else 0)
    if missing:
        raise ComposerError(f"{table}: {missing} rows of month {month} reference no run; "
                            "the month was rolled back")


def analyze_month(conn: Conn, month: str) -> None:
    """Fresh statistics for the month's partitions (row estimates for the notebooks)."""
    for table in ("workflow_runs", "task_instances", "workflow_events"):
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(f"{table}_p{month}")))


# -- the live driver --------------------------------------------------------------------


def running_tasks(conn: Conn, owners: Sequence[str]) -> list[tuple[str, str, str, int]]:
    """``(lease_owner, run_id, task_id, attempt)`` of the RUNNING tasks leased to ``owners``."""
    rows = conn.execute("""
        SELECT lease_owner, run_id, id, attempt FROM task_instances
         WHERE state = 'RUNNING' AND lease_owner = ANY(%s)""", (list(owners),)).fetchall()
    return [(str(o), str(r), str(t), int(a)) for o, r, t, a in rows]


def finished_runs(conn: Conn, run_ids: Sequence[str]) -> list[str]:
    """Those of ``run_ids`` no longer RUNNING."""
    rows = conn.execute("SELECT id FROM workflow_runs WHERE id = ANY(%s) AND status <> 'RUNNING'",
                        (list(run_ids),)).fetchall()
    return [str(r[0]) for r in rows]


def waiting_signals(conn: Conn, run_ids: Sequence[str]) -> list[tuple[str, str]]:
    """``(run_id, signal name)`` of the WAIT_FOR_SIGNAL tasks of ``run_ids`` now waiting."""
    rows = conn.execute("""
        SELECT run_id, signal_name FROM task_instances
         WHERE run_id = ANY(%s) AND state = 'WAITING' AND signal_name IS NOT NULL""",
                        (list(run_ids),)).fetchall()
    return [(str(r), str(e)) for r, e in rows]


# -- the summary --------------------------------------------------------------------------


def live_counts(conn: Conn, run_ids: Sequence[str], lease_error: str) -> tuple[
        list[tuple[str, int]], list[tuple[str, str, int, int, int, int, int]]]:
    """Runs per status, and tasks per (node type, state) with: how many were retried,
    their attempts beyond the first, how many have a last error matching the LIKE
    pattern ``lease_error``, how many are RUNNING with a lease."""
    ids = list(run_ids)
    runs = conn.execute("SELECT status, count(*) FROM workflow_runs WHERE id = ANY(%s) GROUP BY 1",
                        (ids,)).fetchall()
    tasks = conn.execute("""
        SELECT node_type, state, count(*), count(*) FILTER (WHERE attempt > 0), COALESCE(sum(attempt), 0),
               count(*) FILTER (WHERE last_error->>'error' LIKE %s),
               count(*) FILTER (WHERE state = 'RUNNING' AND lease_expires_at IS NOT NULL)
          FROM task_instances WHERE run_id = ANY(%s) GROUP BY 1, 2""", (lease_error, ids)).fetchall()
    return ([(str(s), int(n)) for s, n in runs],
            [(str(t), str(s), int(n), int(r), int(a), int(le), int(rl)) for t, s, n, r, a, le, rl in tasks])


def signal_counts(conn: Conn, run_ids: Sequence[str]) -> tuple[int, int, int]:
    """Buffered signals of ``run_ids``, how many were consumed, and their dispatches
    waiting in the outbox."""
    ids = list(run_ids)
    events = conn.execute("SELECT count(*), count(consumed_at) FROM workflow_events WHERE run_id = ANY(%s)",
                          (ids,)).fetchone()
    outbox = conn.execute("SELECT count(*) FROM task_outbox WHERE run_id = ANY(%s)", (ids,)).fetchone()
    return (int(events[0]) if events else 0, int(events[1]) if events else 0, int(outbox[0]) if outbox else 0)


def moved_attempts(conn: Conn, held: Sequence[tuple[str, str, int]]) -> int:
    """How many of the ``(run_id, task_id, attempt)`` tasks are now past that attempt."""
    if not held:
        return 0
    row = conn.execute("""
        SELECT count(*) FROM task_instances t
          JOIN unnest(%s::text[], %s::text[], %s::int[]) AS h(run_id, id, attempt)
            ON t.run_id = h.run_id AND t.id = h.id
         WHERE t.attempt > h.attempt""",
                       ([r for r, _, _ in held], [t for _, t, _ in held], [a for _, _, a in held])).fetchone()
    return int(row[0]) if row else 0


def runs_per_month(conn: Conn) -> list[tuple[str, str, int]]:
    """Runs per partition month and status: ``(YYYYMM, status, runs)``, one query per
    month's partition, named after it. (The partition a row comes from is not read from
    ``tableoid``: on Citus a query over many shards reports the shards' OIDs, which name
    nothing on the coordinator.)"""
    out: list[tuple[str, str, int]] = []
    for month in sorted({p.month for p in partitions.list_partitions(conn)
                         if p.table == "workflow_runs" and p.month}):
        rows = conn.execute(sql.SQL("SELECT status, count(*) FROM {} GROUP BY 1 ORDER BY 1").format(
            sql.Identifier(f"workflow_runs_p{month}"))).fetchall()
        out += [(month, str(status), int(n)) for status, n in rows]
    return out

