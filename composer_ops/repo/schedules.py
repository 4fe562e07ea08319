"""Schedules (``schedules``) and what happened to their slots (``schedule_events``).

The coordinator reads only the schedules whose ``wake_at`` has come, through the
partial index ``idx_schedules_wake``, and takes each with ``FOR UPDATE SKIP LOCKED``:
two coordinators never decide one schedule at once. Operator actions wait for the row
lock instead (they must not be skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from composer_ops.core.model import ACTIVE_RUN_STATUSES
from composer_ops.errors import Conflict, LockTimeout
from composer_ops.repo._base import Conn, fetch_all, fetch_one, jsonb, sql_states


@dataclass(frozen=True, kw_only=True)
class ScheduleRow:
    """One schedule as stored."""

    id: str
    name: str
    workflow_id: str
    cron: str
    timezone: str
    input: Any
    overlap: str
    catchup: str
    paused: bool
    next_slot_at: datetime | None
    wake_at: datetime | None
    buffered_slot_at: datetime | None
    last_slot_at: datetime | None
    last_run_id: str | None
    last_started_at: datetime | None
    missed_slots: int
    skipped_slots: int
    last_missed_slot_at: datetime | None
    last_not_started_reason: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, kw_only=True)
class ScheduleEvent:
    """What happened to one slot, or to a run of consecutive slots with one reason."""

    kind: str                       # started, buffered, missed, skipped
    source: str                     # cron, trigger, backfill
    first_slot_at: datetime
    last_slot_at: datetime
    slots: int = 1
    run_id: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class ScheduleEventRow(ScheduleEvent):
    id: int
    schedule_id: str
    at: datetime


@dataclass(frozen=True, kw_only=True)
class ScheduleSummary(ScheduleRow):
    """A schedule with its last run's status, as the database clock ``now`` reads it."""

    last_run_status: str | None
    now: datetime


_COLUMNS = """id, name, workflow_id, cron, timezone, input_json AS input, overlap, catchup, paused, next_slot_at,
              wake_at, buffered_slot_at, last_slot_at, last_run_id, last_started_at, missed_slots, skipped_slots,
              last_missed_slot_at, last_not_started_reason, created_at, updated_at"""


def insert(conn: Conn, *, schedule_id: str, name: str, workflow_id: str, cron: str, timezone: str, input: Any,
           overlap: str, catchup: str, next_slot_at: datetime | None, now: datetime) -> ScheduleRow:
    """Create a schedule; :class:`Conflict` when a schedule of that name exists (the
    transaction stays usable)."""
    row = fetch_one(conn, ScheduleRow, f"""
        INSERT INTO schedules (id, name, workflow_id, cron, timezone, input_json, overlap, catchup, next_slot_at,
                               wake_at, created_at, updated_at)
        VALUES (%(id)s, %(name)s, %(wf)s, %(cron)s, %(tz)s, %(input)s, %(overlap)s, %(catchup)s, %(next)s,
                %(next)s, %(now)s, %(now)s)
        ON CONFLICT (name) WHERE deleted_at IS NULL DO NOTHING
        RETURNING {_COLUMNS}""",
        {"id": schedule_id, "name": name, "wf": workflow_id, "cron": cron, "tz": timezone, "input": jsonb(input),
         "overlap": overlap, "catchup": catchup, "next": next_slot_at, "now": now})
    if row is None:
        raise Conflict(f"schedule {name!r} already exists (delete it first, or pick another name)")
    return row


def by_name(conn: Conn, name: str, *, lock: bool = False) -> ScheduleRow | None:
    """The schedule called ``name`` (not deleted); with ``lock``, its row lock, waited for."""
    return fetch_one(conn, ScheduleRow, f"""
        SELECT {_COLUMNS} FROM schedules WHERE name = %s AND deleted_at IS NULL
        {"FOR UPDATE" if lock else ""}""", (name,))


def due(conn: Conn, now: datetime, limit: int) -> list[str]:
    """The ids of at most ``limit`` schedules whose ``wake_at`` has come, the most
    overdue first (the partial index on ``wake_at``)."""
    rows = conn.execute("""
        SELECT id FROM schedules
         WHERE wake_at <= %s AND NOT paused AND deleted_at IS NULL AND wake_at IS NOT NULL
         ORDER BY wake_at LIMIT %s""", (now, limit)).fetchall()
    return [r[0] for r in rows]


def lock_due(conn: Conn, schedule_id: str, now: datetime, *, wait_s: float | None = None) -> ScheduleRow | None:
    """Lock the schedule if it is still due at ``now``; None when it is not (another
    coordinator decided it) or another transaction holds it (one is deciding it now).

    ``wait_s``: wait up to that many seconds for a transaction holding the row, rather
    than skip it at once (then the row is judged again once that transaction ended):
    a pass retried after its connection was cut, whose lost attempt's session may still
    hold the lock until the server notices the cut. Still held after ``wait_s``: None,
    the caller's transaction usable (the wait is in a savepoint)."""
    query = f"""
        SELECT {_COLUMNS} FROM schedules
         WHERE id = %s AND wake_at <= %s AND NOT paused AND deleted_at IS NULL
           FOR UPDATE{" SKIP LOCKED" if wait_s is None else ""}"""
    if wait_s is None:
        return fetch_one(conn, ScheduleRow, query, (schedule_id, now))
    try:
        with conn.transaction():
            row = conn.execute("SELECT current_setting('lock_timeout'), "
                               "set_config('lock_timeout', %s, true)",
                               (f"{max(1, round(wait_s * 1000))}ms",)).fetchone()
            assert row is not None
            found = fetch_one(conn, ScheduleRow, query, (schedule_id, now))
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (row[0],))
            return found
    except LockTimeout:
        return None


def advance(conn: Conn, schedule_id: str, *, next_slot_at: datetime | None, wake_at: datetime | None,
            buffered_slot_at: datetime | None, missed: int, skipped: int, last_missed: datetime | None,
            reason: str | None, now: datetime) -> None:
    """Move the slot cursor after a pass decided the slots before it; count the slots it
    did not start, and keep the newest missed one and the reason of the last not started."""
    conn.execute("""
        UPDATE schedules SET next_slot_at = %(next)s, wake_at = %(wake)s, buffered_slot_at = %(buffered)s,
               missed_slots = missed_slots + %(missed)s, skipped_slots = skipped_slots + %(skipped)s,
               last_missed_slot_at = GREATEST(last_missed_slot_at, %(last_missed)s),
               last_not_started_reason = COALESCE(%(reason)s, last_not_started_reason), updated_at = %(now)s
         WHERE id = %(id)s""",
        {"next": next_slot_at, "wake": wake_at, "buffered": buffered_slot_at, "missed": missed, "skipped": skipped,
         "last_missed": last_missed, "reason": reason, "now": now, "id": schedule_id})


def set_last_run(conn: Conn, schedule_id: str, *, slot: datetime, run_id: str, now: datetime) -> None:
    """The run the schedule started last (what its overlap policy is judged against)."""
    conn.execute("""
        UPDATE schedules SET last_slot_at = %s, last_run_id = %s, last_started_at = %s, updated_at = %s
         WHERE id = %s""", (slot, run_id, now, now, schedule_id))


def set_paused(conn: Conn, schedule_id: str, *, paused: bool, next_slot_at: datetime | None,
               now: datetime) -> None:
    """Pause (the cursor stays), or resume from ``next_slot_at`` with nothing buffered."""
    conn.execute("""
        UPDATE schedules SET paused = %(paused)s, updated_at = %(now)s,
               next_slot_at = CASE WHEN %(paused)s THEN next_slot_at ELSE %(next)s END,
               wake_at = CASE WHEN %(paused)s THEN wake_at ELSE %(next)s END,
               buffered_slot_at = CASE WHEN %(paused)s THEN buffered_slot_at END
         WHERE id = %(id)s""", {"paused": paused, "next": next_slot_at, "now": now, "id": schedule_id})


def soft_delete(conn: Conn, schedule_id: str, now: datetime) -> None:
    conn.execute("UPDATE schedules SET deleted_at = %s, updated_at = %s, wake_at = NULL WHERE id = %s",
                 (now, now, schedule_id))


def record(conn: Conn, schedule_id: str, events: Sequence[ScheduleEvent], now: datetime) -> None:
    """Append ``events`` in order, in one statement."""
    if not events:
        return
    conn.execute("""
        INSERT INTO schedule_events (schedule_id, at, kind, source, first_slot_at, last_slot_at, slots, run_id,
                                     reason)
        SELECT %(sid)s, %(at)s, k, s, f, l, n, r, w
          FROM unnest(%(kinds)s::text[], %(sources)s::text[], %(firsts)s::timestamptz[], %(lasts)s::timestamptz[],
                      %(counts)s::int4[], %(runs)s::text[], %(reasons)s::text[]) WITH ORDINALITY
               AS e(k, s, f, l, n, r, w, i)
         ORDER BY i""",
        {"sid": schedule_id, "at": now, "kinds": [e.kind for e in events], "sources": [e.source for e in events],
         "firsts": [e.first_slot_at for e in events], "lasts": [e.last_slot_at for e in events],
         "counts": [e.slots for e in events], "runs": [e.run_id for e in events],
         "reasons": [e.reason for e in events]})


def run_active(conn: Conn, run_id: str) -> bool:
    """Whether the run is still active (the overlap policy's question); a run deleted
    or gone with its month is not."""
    row = conn.execute(f"""
        SELECT 1 FROM workflow_runs WHERE id = %s AND deleted_at IS NULL
           AND status IN {sql_states(ACTIVE_RUN_STATUSES)}""", (run_id,)).fetchone()
    return row is not None


def existing_runs(conn: Conn, run_ids: Sequence[str]) -> set[str]:
    """Which of ``run_ids`` exist (a backfill's dry run: those slots have their run)."""
    if not run_ids:
        return set()
    rows = conn.execute("SELECT id FROM workflow_runs WHERE id = ANY(%s)", (list(run_ids),)).fetchall()
    return {r[0] for r in rows}


def summaries(conn: Conn) -> list[ScheduleSummary]:
    """Every schedule (not deleted) by name, with its last run's status (one row each:
    the counters live on the schedule's row) and the database clock."""
    return fetch_all(conn, ScheduleSummary, f"""
        SELECT {", ".join("s." + c.strip() for c in _COLUMNS.split(","))}, r.status AS last_run_status,
               now() AS now
          FROM schedules s
          LEFT JOIN workflow_runs r ON r.id = s.last_run_id
         WHERE s.deleted_at IS NULL
         ORDER BY s.name""", ())


def events(conn: Conn, schedule_id: str | None = None, *, limit: int = 100) -> list[ScheduleEventRow]:
    """The newest ``limit`` events (of one schedule, or of all), newest first."""
    return fetch_all(conn, ScheduleEventRow, """
        SELECT id, schedule_id, at, kind, source, first_slot_at, last_slot_at, slots, run_id, reason
          FROM schedule_events
         WHERE %(sid)s::text IS NULL OR schedule_id = %(sid)s
         ORDER BY id DESC LIMIT %(limit)s""", {"sid": schedule_id, "limit": limit})
