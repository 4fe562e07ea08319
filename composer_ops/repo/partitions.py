"""Thin wrappers over the composer_* partition functions, and the partition list."""

from __future__ import annotations

from datetime import date, datetime
from functools import lru_cache
from typing import Any, NamedTuple
from weakref import WeakKeyDictionary

from psycopg import sql
from psycopg.errors import UndefinedFunction, UndefinedTable

from composer_ops.core.runids import month_bounds, month_of
from composer_ops.errors import ComposerError, Invalid
from composer_ops.repo._base import Conn, fetch_all
from composer_ops.repo.rows import PartitionRow

#: The run-scoped tables partitioned by month, in foreign-key order (the SQL
#: functions' list is composer_run_tables()).
RUN_TABLES = ("workflow_runs", "task_instances", "workflow_events", "run_history")


def runs_partition(run_id: str) -> str:
    """The name of the ``workflow_runs`` partition that holds a (canonical UUIDv7) run ID."""
    return f"workflow_runs_p{month_of(run_id)}"


class RunTables(NamedTuple):
    """Where a run's own rows are addressed (:func:`month_tables`): its ``workflow_runs``
    and ``task_instances`` tables, and ``load``, the SQL function that takes its lock and
    loads it on them (sql/R__apply.sql, ``composer_load_run_source``)."""

    runs: str
    tasks: str
    load: str


#: The partitioned tables, for a run whose month cannot be named.
PARTITIONED = RunTables("workflow_runs", "task_instances", "composer_load_run")

#: Per connection, what :func:`month_tables` found for each month: the month's own
#: partitions (and its load function, when there is one) when its ``workflow_runs`` and
#: ``task_instances`` partitions are attached with the month's own bounds and this role
#: may read and update them, :data:`PARTITIONED` otherwise.
_CHECKED: WeakKeyDictionary[Conn, dict[str, RunTables]] = WeakKeyDictionary()

_CHECK_SQL = """
    SELECT count(*) FILTER (
               WHERE pg_get_expr(c.relpartbound, c.oid)
                         = format('FOR VALUES FROM (%%L) TO (%%L)', %(lo)s::text, %(hi)s::text)
                 AND has_table_privilege(c.oid, 'SELECT') AND has_table_privilege(c.oid, 'UPDATE')) = 2,
           count(*) = 2,
           COALESCE(has_function_privilege(to_regprocedure(%(load)s)::oid, 'EXECUTE'), false)
      FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
     WHERE (c.oid, i.inhparent) IN ((to_regclass(%(runs)s), 'workflow_runs'::regclass),
                                    (to_regclass(%(tasks)s), 'task_instances'::regclass))"""


def run_tables(conn: Conn, run_id: str) -> tuple[str, str]:
    """The tables to address a run's own rows in: ``(runs, tasks)`` of
    :func:`month_tables`."""
    found = month_tables(conn, run_id)
    return found.runs, found.tasks


def month_tables(conn: Conn, run_id: str) -> RunTables:
    """The tables to address a run's own rows in, its month's partitions of
    ``workflow_runs`` and ``task_instances`` by name, or the two partitioned tables when
    that cannot be trusted; and the function that locks and loads the run on them.

    A statement on a partitioned table that names a run is planned at every call: a
    cached generic plan would lock every month before pruning (PostgreSQL 15 to 18), so
    the plan cache keeps making custom plans, at 0.06 to 0.16 ms of server CPU each. The
    same statement on the month's partition is an ordinary table's: planned once,
    cached, and it locks that month only. So is the month's load function,
    ``composer_load_run_pYYYYMM``, made with the month (not on Citus, where
    ``composer_load_run`` on the partitioned tables serves every month).

    The name is the run ID's UTC month; it is used only after this connection has seen
    both partitions attached with exactly that month's bounds and found it may read and
    update them (one catalog query per month per connection: PostgreSQL checks a named
    partition's own privileges, which sql/R__partitions.sql grants the engine role). A partition
    made with other bounds (``_misaligned`` data), one the role has no privileges on, or
    a run ID that is not a canonical UUIDv7 falls back to the partitioned tables.
    A partition dropped or detached after that check (and the month's load function with
    it) makes the statement fail with ``UndefinedTable`` (a detached month is also moved
    out of the schema) or ``UndefinedFunction``, which the caller handles after
    :func:`gone_since_checked`."""
    try:
        month = month_of(run_id)
    except ComposerError:
        return PARTITIONED
    seen = _CHECKED.setdefault(conn, {})
    found = seen.get(month)
    if found is None:
        lo, hi = month_bounds(month)
        load = f"composer_load_run_p{month}"
        row = conn.execute(_CHECK_SQL, {"runs": f"workflow_runs_p{month}", "tasks": f"task_instances_p{month}",
                                        "lo": lo, "hi": hi, "load": f"{load}(text)"}).fetchone()
        found = PARTITIONED
        if row and row[0]:
            found = RunTables(f"workflow_runs_p{month}", f"task_instances_p{month}",
                              load if row[2] else PARTITIONED.load)
        if row and (row[0] or row[1]):   # a month not made yet is checked again next time
            seen[month] = found
    return found


@lru_cache(maxsize=512)
def on_tables(statement: str, runs: str, tasks: str) -> str:
    """``statement`` with its ``{runs}`` and ``{tasks}`` tables named (from
    :func:`run_tables`); the same text for the same tables, so psycopg prepares it once."""
    return statement.replace("{runs}", f'"{runs}"').replace("{tasks}", f'"{tasks}"')


def forget_month(conn: Conn, run_id: str) -> None:
    """Check the month of ``run_id`` again at its next use on ``conn`` (its partition
    was not there, or did not hold the run)."""
    try:
        _CHECKED.get(conn, {}).pop(month_of(run_id), None)
    except ComposerError:
        pass


def gone_since_checked(conn: Conn, run_id: str, table: str, exc: ComposerError) -> bool:
    """True when ``exc`` says ``table``, a month partition :func:`month_tables` named for
    ``run_id``, was dropped or detached since this connection checked it (or the month's
    load function, dropped with it); the month is then checked again at its next use.
    False for the partitioned tables and for any other error, which the caller raises
    again."""
    if table in ("workflow_runs", "task_instances") \
            or not isinstance(exc.__cause__, UndefinedTable | UndefinedFunction):
        return False
    forget_month(conn, run_id)
    return True


def require_run_partition(conn: Conn, run_id: str) -> None:
    """``Invalid`` unless a partition holds the month of ``run_id`` (a canonical UUIDv7)."""
    name = runs_partition(run_id)
    found = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()
    if not found or not found[0]:
        raise no_partition(run_id)


def no_partition(run_id: str) -> Invalid:
    """The error of a run ID whose month has no partition (a canonical UUIDv7)."""
    return Invalid(f"run id {run_id}: no partition holds this run ID's month ({runs_partition(run_id)} does not "
                   "exist); run `composer-ops partitions ensure` or use a recent run ID")


def ensure(conn: Conn, months_ahead: int = 3, *, lock_timeout_s: float | None = 2.0) -> int:
    """Create this UTC month and ``months_ahead`` more for every run table; returns
    how many partitions were created.

    Each partition is created on its own and attached, which never waits for readers;
    attaching still waits for transactions writing ``workflow_runs`` (the foreign
    keys), and every start or signal would queue behind that wait, so it is bounded by
    ``lock_timeout_s`` for the rest of the caller's transaction: past it the statement
    fails with ``LockTimeout`` and the caller tries again later. ``None`` keeps
    the session's setting."""
    one_connection_per_node(conn)
    if lock_timeout_s is not None:
        set_lock_timeout(conn, lock_timeout_s)
    row = conn.execute("SELECT composer_ensure_partitions(%s)", (months_ahead,)).fetchone()
    return int(row[0]) if row else 0


def one_connection_per_node(conn: Conn) -> None:
    """On Citus, run the rest of the caller's transaction over one connection per node
    (``citus.multi_shard_modify_mode = 'sequential'``). DDL on a distributed table fans
    out over several connections per node; a transaction that creates, attaches, locks
    or drops several partitions then has Citus refuse its later statements ("cannot
    modify table ... because there was a parallel operation on a distributed table").
    Set by the caller rather than on the partition functions, which every migration
    that replaces them would reset. On a single server the setting is an inert
    placeholder."""
    conn.execute("SELECT set_config('citus.multi_shard_modify_mode', 'sequential', true)")


def set_lock_timeout(conn: Conn, seconds: float, *, citus: bool = False) -> None:
    """``SET LOCAL lock_timeout``: until the end of the caller's transaction, a lock
    wait longer than ``seconds`` fails its statement with lock_not_available
    (:class:`~composer_ops.errors.LockTimeout`). ``citus``: also on the worker nodes the
    transaction uses, where a run's statements wait: Citus sends a transaction's SET
    LOCAL statements (not ``set_config``) to them with ``citus.propagate_set_commands =
    'local'``, set here for the transaction too (without it a wait there never times
    out: tests/citus/test_coordinator.py hangs). One round trip, two with ``citus``."""
    if citus:
        conn.execute("SET LOCAL citus.propagate_set_commands = 'local'")
    # The server takes at most INT_MAX ms (about 24.8 days); a longer wait is that one.
    millis = min(2_147_483_647, max(1, round(seconds * 1000)))
    conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{millis}ms")))


def ensure_from(conn: Conn, first_month: date, months_ahead: int) -> int:
    """Like :func:`ensure`, starting at the month containing ``first_month`` (may be past)."""
    one_connection_per_node(conn)
    row = conn.execute("SELECT composer_ensure_partitions_from(%s, %s)", (first_month, months_ahead)).fetchone()
    return int(row[0]) if row else 0


# Every partition of the run-scoped tables, with its bound expression decoded from the
# catalog, and its rows and sizes summed over the nodes that hold its data
# (composer_partition_stats(), sql/R__partitions.sql; on Citus the shards,
# sql/citus/R__partition_stats.sql).
CATALOG_SQL = """
    SELECT p.relname::text AS table, c.relname::text AS name,
           COALESCE(substring(c.relname FROM '_p(\\d{6})$'), '') AS month,
           COALESCE(substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \\(''([^'']*)''\\)'), '')
               AS lower_bound,
           COALESCE(substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \\(''([^'']*)''\\)'), '')
               AS upper_bound,
           COALESCE(st.rows, 0)::bigint AS rows, COALESCE(st.heap_bytes, 0)::bigint AS heap_bytes,
           COALESCE(st.index_bytes, 0)::bigint AS index_bytes, COALESCE(st.toast_bytes, 0)::bigint AS toast_bytes,
           COALESCE(st.total_bytes, 0)::bigint AS total_bytes,
           composer_misaligned_bounds(c.oid::regclass) IS NULL AS bounds_match
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
      JOIN pg_class p ON p.oid = i.inhparent
      LEFT JOIN (SELECT partition, sum(rows) AS rows, sum(heap_bytes) AS heap_bytes, sum(index_bytes) AS index_bytes,
                        sum(toast_bytes) AS toast_bytes, sum(total_bytes) AS total_bytes
                   FROM composer_partition_stats() GROUP BY partition) st ON st.partition = c.relname
     WHERE p.oid = ANY(composer_run_tables()::regclass[])
     ORDER BY month, array_position(composer_run_tables(), p.relname::text), c.relname
"""

# The same per node: where each partition's data is (one node, 'local', on a single server).
NODES_SQL = """
    SELECT partition, node, rows, heap_bytes, index_bytes, toast_bytes, total_bytes
      FROM composer_partition_stats()
     ORDER BY partition, node
"""


def list_partitions(conn: Conn) -> list[PartitionRow]:
    """Every partition of the run-scoped tables with its declared bounds."""
    return fetch_all(conn, PartitionRow, f"""
        SELECT "table", name, month, lower_bound, upper_bound FROM ({CATALOG_SQL}) c""", None)


def catalog(conn: Conn) -> list[tuple[Any, ...]]:
    """Every partition: table, name, month (YYYYMM, '' when the name has none),
    lower_bound, upper_bound, rows (catalog estimate), heap_bytes, index_bytes,
    toast_bytes, total_bytes, bounds_match (whether its bounds are exactly its name's
    month's: ``composer_misaligned_bounds``, the check the retention plan makes too).
    Reads catalogs only."""
    return conn.execute(CATALOG_SQL.encode()).fetchall()


def node_stats(conn: Conn) -> list[tuple[Any, ...]]:
    """Every partition per node that holds its data: partition, node ('local' on a
    single server, 'host:port' of a Citus node), rows (estimate), heap_bytes,
    index_bytes, toast_bytes, total_bytes."""
    return conn.execute(NODES_SQL.encode()).fetchall()


def count_rows(conn: Conn, partition: str) -> int:
    """The exact row count of one partition (a full scan of it)."""
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(partition))).fetchone()
    return int(row[0]) if row else 0


def age_before_now(conn: Conn, *, years: int = 0, months: int = 0, weeks: int = 0, days: int = 0,
                   hours: int = 0, minutes: int = 0) -> datetime:
    """The database clock minus an age, in calendar arithmetic on the UTC wall clock,
    so the session TimeZone (and its DST changes) cannot shift it. An age reaching back
    past the year 2 gives 0002-01-01 UTC: long before any run or partition, and an
    instant Python and PostgreSQL can both hold in any time zone (the age is first
    capped at 5000 years, which PostgreSQL can subtract from any date of ours)."""
    row = conn.execute(
        """SELECT GREATEST((now() AT TIME ZONE 'UTC')
                           - LEAST(make_interval(years => %(y)s, months => %(mo)s, weeks => %(w)s, days => %(d)s,
                                                 hours => %(h)s, mins => %(mi)s), INTERVAL '5000 years'),
                           TIMESTAMP '0002-01-01 00:00:00') AT TIME ZONE 'UTC'""",
        {"y": years, "mo": months, "w": weeks, "d": days, "h": hours, "mi": minutes}).fetchone()
    assert row is not None
    value: datetime = row[0]
    return value
