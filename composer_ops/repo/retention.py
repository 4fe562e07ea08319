"""Retention: the cut-off, the plan of every partition month, and the drop.

The plan is one SQL function, ``composer_retention_plan`` (sql/R__retention.sql): the dry-run,
the retention report and the real drop all read it through :func:`plan`. The drop
(``composer_drop_partitions``) locks each month the plan would drop before judging
it again, so a run that commits into a month while the drop waits is kept, never
dropped. Dropped months are recorded in ``retention_drops`` with the request that
dropped them, in the same transaction, so a retried request finds what it did.

Cut-offs are parsed in ``core.cutoff``; :func:`resolve` counts an age back from the
database clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg import sql

from composer_ops.core.cutoff import Cutoff, parse_cutoff
from composer_ops.core.runids import RUN_ID_MAX_AGE
from composer_ops.errors import Invalid
from composer_ops.repo import partitions
from composer_ops.repo._base import Conn, fetch_all
from composer_ops.repo.rows import RetentionMonth

# -- retention_plan -- the plan rows, oldest month first.
PLAN_SQL = """
    SELECT month, month_start, month_end, action, reason, active_runs, active_run_ids, partitions, rows, bytes
      FROM composer_retention_plan(%(cutoff)s, %(exact)s, %(min_age)s)
     ORDER BY month
"""

#: The advisory lock partition upkeep and the drop serialise on.
PARTITION_LOCK = "SELECT pg_advisory_xact_lock(hashtext('composer_partitions'))"


def lock_partitions(conn: Conn) -> None:
    """Take the partition advisory lock for the rest of the transaction (the one the
    SQL partition functions take), so no upkeep or other drop runs beside it. First
    statement of a drop's transaction: on Citus it also puts the transaction in
    sequential mode, before the plan's reads over the shards, which Citus otherwise runs
    in parallel and then refuses the drop's DDL after ("cannot modify table ... because
    there was a parallel operation on a distributed table")."""
    partitions.one_connection_per_node(conn)
    conn.execute(PARTITION_LOCK)


def resolve(conn: Conn, older_than: datetime | str | Cutoff) -> datetime:
    """Any accepted form of cut-off as an instant (UTC)."""
    if isinstance(older_than, str):
        older_than = parse_cutoff(older_than)
    if isinstance(older_than, Cutoff):
        if older_than.instant is not None:
            return older_than.instant
        # calendar arithmetic on the UTC wall clock: the session TimeZone cannot shift it
        return partitions.age_before_now(conn, **{older_than.unit: older_than.amount}).astimezone(UTC)
    if older_than.tzinfo is None:
        raise Invalid(f"cut-off {older_than.isoformat()} has no time zone; pass an aware datetime (UTC)")
    return older_than.astimezone(UTC)


def plan_params(cutoff: datetime, min_age: timedelta, exact_rows: bool = False) -> dict[str, Any]:
    return {"cutoff": cutoff, "exact": exact_rows, "min_age": min_age}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The retention plan for one cut-off (an instant, UTC): every partition month,
    oldest first."""

    cutoff: datetime
    months: list[RetentionMonth]

    @property
    def due(self) -> list[RetentionMonth]:
        """The months the plan drops."""
        return [m for m in self.months if m.action == "drop"]

    @property
    def kept(self) -> list[tuple[str, str]]:
        """``(month, reason)`` of the months the plan keeps."""
        return [(m.month, m.reason) for m in self.months if m.action != "drop"]


def plan(conn: Conn, older_than: datetime | str | Cutoff, *, min_age: timedelta = RUN_ID_MAX_AGE,
         exact_rows: bool = False) -> Plan:
    """The plan for any form of cut-off (:func:`resolve`), for every partition month:
    drop or keep, why ('too new', 'has active runs' with the first 20 blocking run IDs,
    or 'past cut-off, no active runs'), and the rows (catalog estimates unless
    ``exact_rows``) and bytes of its partitions. A month is 'too new' until it ended at
    or before the cut-off and at least ``min_age`` ago (by default the oldest a run ID
    the engine accepts may be, so no start can still land in a dropped month)."""
    cutoff = resolve(conn, older_than)
    months = fetch_all(conn, RetentionMonth, PLAN_SQL, plan_params(cutoff, min_age, exact_rows))
    return Plan(cutoff=cutoff, months=months)


def lock_months(conn: Conn, months: list[RetentionMonth], *, exclusive: bool = True) -> None:
    """Lock every partition of ``months`` (in the plan's order: composer_run_tables():
    workflow_runs first) for the rest of the transaction: ACCESS EXCLUSIVE, after their
    parents' (:func:`lock_parents`); or, with ``exclusive`` false, SHARE, which keeps
    writers out while readers of the month go on, to judge and read it before dropping
    it. Holding a month's ACCESS EXCLUSIVE lock while waiting for a parent's would
    deadlock with any reader of the parent (the coordinator's scans lock the parent,
    then each month)."""
    for month in months:
        lock_tables(conn, month.partitions, exclusive=exclusive, parents=month is months[0])


def lock_tables(conn: Conn, names: list[str], *, exclusive: bool = True, parents: bool = True) -> None:
    """Lock the partitions ``names`` as :func:`lock_months` locks a month's (with
    ``parents``, the run tables first when ``exclusive``)."""
    if not names:
        return
    partitions.one_connection_per_node(conn)
    if exclusive and parents:
        lock_parents(conn)
    mode = sql.SQL("ACCESS EXCLUSIVE" if exclusive else "SHARE")
    conn.execute(sql.SQL("LOCK TABLE {} IN {} MODE").format(
        sql.SQL(", ").join(sql.Identifier(p) for p in names), mode))


def lock_parents(conn: Conn) -> None:
    """ACCESS EXCLUSIVE on the run tables themselves (not their partitions), in
    composer_run_tables() order, as dropping or detaching a partition needs: taken
    before any month's ACCESS EXCLUSIVE lock, the order PostgreSQL locks a partitioned
    table and its partitions in."""
    conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
        sql.SQL(", ").join(sql.SQL("ONLY {}").format(sql.Identifier(t)) for t in partitions.RUN_TABLES)))


def drop(conn: Conn, cutoff: datetime, *, min_age: timedelta) -> list[str]:
    """``composer_drop_partitions``: lock what the plan would drop, judge it again under
    the locks, drop what is still due; returns the dropped months (YYYYMM)."""
    partitions.one_connection_per_node(conn)
    return [str(r[0]) for r in conn.execute("SELECT composer_drop_partitions(%s, %s)", (cutoff, min_age))]


def record(conn: Conn, request_id: str, cutoff: datetime, dropped: list[RetentionMonth]) -> None:
    """Remember what this request dropped, in its own transaction."""
    for month in dropped:
        conn.execute("""INSERT INTO retention_drops (month, partitions, rows, bytes, cutoff, request_id)
                        VALUES (%s, %s, %s, %s, %s, %s)""",
                     (month.month, list(month.partitions), month.rows, month.bytes, cutoff, request_id))


def recorded(conn: Conn, request_id: str) -> tuple[datetime, list[RetentionMonth]] | None:
    """What an earlier attempt of this request dropped (and its cut-off), if it committed."""
    rows = conn.execute("""SELECT month, partitions, rows, bytes, cutoff FROM retention_drops
                            WHERE request_id = %s ORDER BY month""", (request_id,)).fetchall()
    if not rows:
        return None
    out = []
    for month, parts, n, size, _ in rows:
        start = datetime(int(month[:4]), int(month[4:]), 1, tzinfo=UTC)
        end = datetime(start.year + (start.month == 12), start.month % 12 + 1, 1, tzinfo=UTC)
        out.append(RetentionMonth(month=month, month_start=start, month_end=end, action="drop",
                                  reason="past cut-off, no active runs", active_runs=0, active_run_ids=[],
                                  partitions=list(parts), rows=n, bytes=size))
    return rows[0][4].astimezone(UTC), out
