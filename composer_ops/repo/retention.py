"""Retention: the cut-off, the plan of every partition month, and the drop.

The plan is one SQL function, ``composer_retention_plan`` (sql/R__retention.sql): the dry-run,
the retention report and the real drop all read it through :func:`plan`. The drop
(``composer_drop_partitions``) locks each month the plan would drop before judging
it again, so a run that commits into a month while the drop waits is kept, never
dropped. Dropped months are recorded in ``retention_drops`` with the request that
dropped them, in the same transaction, so a retried request finds what it did.

Cut-offs: an ISO date (midnight UTC), an ISO instant (UTC when it has no offset), or
an age like ``90d``, ``2w``, ``6 months``, ``1y``, ``36h`` counted back from the
database clock in UTC calendar arithmetic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from psycopg import sql

from composer_ops.errors import Invalid
from composer_ops.repo import partitions
from composer_ops.repo._base import Conn, fetch_all
from composer_ops.repo.rows import RetentionMonth

_RELATIVE = re.compile(r"^\s*(\d{1,6})\s*([a-z]+)\s*$")
_UNITS = {
    "h": "hours", "hour": "hours", "hours": "hours",
    "d": "days", "day": "days", "days": "days",
    "w": "weeks", "week": "weeks", "weeks": "weeks",
    "mo": "months", "mon": "months", "month": "months", "months": "months",
    "y": "years", "year": "years", "years": "years",
}

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


@dataclass(frozen=True, kw_only=True)
class Cutoff:
    """A retention cut-off: an absolute instant, or an age counted back from the database clock."""

    text: str
    instant: datetime | None = None
    amount: int = 0
    unit: str = ""

    def resolve(self, conn: Conn) -> datetime:
        """The cut-off instant (UTC). Relative ages use the database's now(), with the
        calendar arithmetic done on the UTC wall clock so the session TimeZone
        (and its DST changes) cannot shift it."""
        if self.instant is not None:
            return self.instant
        return partitions.age_before_now(conn, **{self.unit: self.amount}).astimezone(UTC)


def parse_cutoff(text: str) -> Cutoff:
    """Parse a --older-than / cutoff value; :class:`Invalid` says what is accepted."""
    if not isinstance(text, str) or not text.strip():
        raise Invalid(f"cut-off {text!r} is empty: give an ISO date (2025-01-31), an ISO instant "
                      "(2025-01-31T12:00:00Z) or an age (90d, 2w, 6 months, 1y, 36h)")
    raw = text.strip()
    rel = _RELATIVE.match(raw.lower())
    if rel:
        unit = _UNITS.get(rel.group(2))
        if unit is None:
            raise Invalid(f"cut-off {text!r}: unknown unit {rel.group(2)!r} (use h, d, w, mo/months or y)")
        return Cutoff(text=raw, amount=int(rel.group(1)), unit=unit)
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", raw):
            day = date.fromisoformat(raw)
            return Cutoff(text=raw, instant=datetime(day.year, day.month, day.day, tzinfo=UTC))
        instant = datetime.fromisoformat(raw.replace("z", "Z"))
    except ValueError as exc:
        raise Invalid(f"cut-off {text!r} is not an ISO date/instant or an age like 90d or 6 months ({exc})") from None
    if instant.tzinfo is None:
        instant = instant.replace(tzinfo=UTC)
    return Cutoff(text=raw, instant=instant.astimezone(UTC))


def resolve(conn: Conn, older_than: datetime | str | Cutoff) -> datetime:
    """Any accepted form of cut-off as an instant (UTC)."""
    if isinstance(older_than, Cutoff):
        return older_than.resolve(conn)
    if isinstance(older_than, str):
        return parse_cutoff(older_than).resolve(conn)
    if older_than.tzinfo is None:
        raise Invalid(f"cut-off {older_than.isoformat()} has no time zone; pass an aware datetime (UTC)")
    return older_than.astimezone(UTC)


def plan_params(cutoff: datetime, min_age: timedelta, exact_rows: bool = False) -> dict[str, Any]:
    return {"cutoff": cutoff, "exact": exact_rows, "min_age": min_age}


def plan(conn: Conn, cutoff: datetime, *, min_age: timedelta, exact_rows: bool = False) -> list[RetentionMonth]:
    """For every partition month: drop or keep, why ('too new', 'has active runs' with
    the first 20 blocking run IDs, or 'past cut-off, no active runs'), and the rows
    (catalog estimates unless ``exact_rows``) and bytes of its partitions. A month is
    'too new' until it ended at or before the cut-off and at least ``min_age`` ago."""
    return fetch_all(conn, RetentionMonth, PLAN_SQL, plan_params(cutoff, min_age, exact_rows))


def lock_months(conn: Conn, months: list[RetentionMonth], *, exclusive: bool = True) -> None:
    """Lock every partition of ``months`` (in the plan's order: composer_run_tables():
    workflow_runs first) for the rest of the transaction: ACCESS EXCLUSIVE, after their
    parents' (:func:`lock_parents`); or, with ``exclusive`` false, SHARE, which keeps
    writers out while readers of the month go on, to judge and read it before dropping
    it. Holding a month's ACCESS EXCLUSIVE lock while waiting for a parent's would
    deadlock with any reader of the parent (the coordinator's scans lock the parent,
    then each month)."""
    if not months:
        return
    partitions.one_connection_per_node(conn)
    if exclusive:
        lock_parents(conn)
    mode = sql.SQL("ACCESS EXCLUSIVE" if exclusive else "SHARE")
    for month in months:
        conn.execute(sql.SQL("LOCK TABLE {} IN {} MODE").format(
            sql.SQL(", ").join(sql.Identifier(p) for p in month.partitions), mode))


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
