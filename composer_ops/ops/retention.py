"""Retention: the plan for a cut-off, and the real drop that follows the same plan.

Both go through one SQL function, ``composer_retention_plan`` (migration V004):
the dry-run shows its rows, and ``composer_drop_partitions`` drops exactly the rows
it marks 'drop'. :func:`drop_partitions` additionally checks, in the same
transaction and under the same advisory lock, that what was dropped equals the plan
it read, and rolls back otherwise.

Cut-offs: an ISO date (midnight UTC), an ISO instant (UTC when it has no offset), or
a relative age like ``90d``, ``2w``, ``6 months``, ``1y``, ``36h`` counted back
from the database clock in UTC calendar arithmetic.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

import polars as pl
import psycopg

from composer_ops.db import connect
from composer_ops.db.retry import db_retry
from composer_ops.errors import ComposerError, Invalid, Transient
from composer_ops.ops._common import UTC_TS, Source, connection, rows_frame
from composer_ops.repo import partitions as repo_partitions

log = logging.getLogger(__name__)

_RELATIVE = re.compile(r"^\s*(\d{1,6})\s*([a-z]+)\s*$")
_UNITS = {
    "h": "hours", "hour": "hours", "hours": "hours",
    "d": "days", "day": "days", "days": "days",
    "w": "weeks", "week": "weeks", "weeks": "weeks",
    "mo": "months", "mon": "months", "month": "months", "months": "months",
    "y": "years", "year": "years", "years": "years",
}

PLAN_SCHEMA = {
    "month": pl.String, "month_start": UTC_TS, "month_end": UTC_TS, "action": pl.String, "reason": pl.String,
    "active_runs": pl.Int64, "active_run_ids": pl.List(pl.String), "partitions": pl.List(pl.String),
    "rows": pl.Int64, "bytes": pl.Int64,
}

# The lock composer_ensure_partitions and composer_drop_partitions serialise on.
_PARTITION_LOCK = "SELECT pg_advisory_xact_lock(hashtext('composer_partitions'))"


@dataclass(frozen=True, kw_only=True)
class Cutoff:
    """A retention cut-off: an absolute instant, or an age counted back from the database clock."""

    text: str
    instant: datetime | None = None
    amount: int = 0
    unit: str = ""

    def resolve(self, conn: psycopg.Connection[Any]) -> datetime:
        """The cut-off instant (UTC). Relative ages use the database's now(), with the
        calendar arithmetic done on the UTC wall clock so the session TimeZone
        (and its DST changes) cannot shift it."""
        if self.instant is not None:
            return self.instant
        return repo_partitions.age_before_now(conn, **{self.unit: self.amount}).astimezone(UTC)


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


def _as_instant(conn: psycopg.Connection[Any], older_than: datetime | str | Cutoff) -> datetime:
    if isinstance(older_than, Cutoff):
        return older_than.resolve(conn)
    if isinstance(older_than, str):
        return parse_cutoff(older_than).resolve(conn)
    if older_than.tzinfo is None:
        raise Invalid(f"cut-off {older_than.isoformat()} has no time zone; pass an aware datetime (UTC)")
    return older_than.astimezone(UTC)


def retention_plan(source: Source = None, older_than: datetime | str | Cutoff = "6 months", *,
                   exact_rows: bool = False) -> pl.DataFrame:
    """For every partition month: drop or keep, why ('too new', 'has active runs' with
    the blocking run IDs, or 'past cut-off, no active runs'), and the rows and bytes
    its partitions hold (rows are catalog estimates unless ``exact_rows``).
    ``cutoff`` is the resolved instant, repeated on each row."""
    with connection(source) as conn:
        cutoff = _as_instant(conn, older_than)
        plan = rows_frame(repo_partitions.retention_plan(conn, cutoff, exact_rows=exact_rows), PLAN_SCHEMA)
    return plan.with_columns(pl.lit(cutoff, dtype=UTC_TS).alias("cutoff"))


@dataclass(frozen=True, kw_only=True)
class DropResult:
    cutoff: datetime
    plan: pl.DataFrame
    dropped: list[str]
    attempts: int


def drop_partitions(source: Source = None, older_than: datetime | str | Cutoff = "6 months", *,
                    lock_timeout_s: float = 2.0, max_attempts: int = 5) -> DropResult:
    """Drop what :func:`retention_plan` marks 'drop', for real, and commit.

    Each attempt is one transaction with ``lock_timeout`` set, so the DETACH/DROP
    never waits in the lock queue long enough to stall the engine behind it; a lock
    timeout rolls back and is retried with jittered backoff. The plan is read under
    the partition advisory lock and compared with what composer_drop_partitions
    returned; any difference rolls everything back.
    """
    if lock_timeout_s <= 0 or max_attempts < 1:
        raise Invalid(f"lock timeout must be > 0 and attempts >= 1, got {lock_timeout_s}s and {max_attempts}")
    attempts = 0
    conn = source if isinstance(source, psycopg.Connection) else connect(
        source, application_name="composer-ops partitions drop")

    @db_retry(max_attempts, base=0.25, cap=4.0)
    def attempt() -> tuple[datetime, pl.DataFrame, list[str]]:
        nonlocal attempts
        attempts += 1
        with conn.transaction():
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(lock_timeout_s * 1000)}ms",))
            cutoff = _as_instant(conn, older_than)
            conn.execute(_PARTITION_LOCK)
            plan = rows_frame(repo_partitions.retention_plan(conn, cutoff), PLAN_SCHEMA)
            dropped = [str(r[0]) for r in conn.execute("SELECT composer_drop_partitions(%s)", (cutoff,)).fetchall()]
            planned = plan.filter(pl.col("action") == "drop")["month"].to_list()
            if dropped != planned:
                raise ComposerError(f"retention aborted: the plan said drop {planned} but the drop "
                                    f"function returned {dropped}; nothing was dropped")
        return cutoff, plan, dropped

    try:
        cutoff, plan, dropped = attempt()
    except Transient as exc:
        if not isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):
            raise
        raise ComposerError(
            f"could not lock the partitions to drop within {lock_timeout_s:g}s in {attempts} attempts "
            "(a long transaction holds them); nothing was dropped, try again later") from exc
    finally:
        if conn is not source:
            conn.close()
    return DropResult(cutoff=cutoff, plan=plan.with_columns(pl.lit(cutoff, dtype=UTC_TS).alias("cutoff")),
                      dropped=dropped, attempts=attempts)
