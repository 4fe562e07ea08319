"""Schedules for the reports and ``check``: each schedule's next and last slot, its last
run, the slots it missed or skipped and why, and whether its last due slot started.

One row per schedule (the counters are kept on the schedule's row), and the newest slot
events; the statements are :mod:`composer_ops.repo.schedules`'.
"""

from __future__ import annotations

from datetime import timedelta

import polars as pl

from composer_ops.core.schedules import late_reason
from composer_ops.errors import Invalid
from composer_ops.ops._common import UTC_TS, Source, connection, rows_frame
from composer_ops.ops.display import duration
from composer_ops.repo import schedules

#: Columns of :func:`schedules_overview`, in order.
OVERVIEW_SCHEMA = {
    "name": pl.String, "workflow_id": pl.String, "cron": pl.String, "timezone": pl.String, "overlap": pl.String,
    "catchup": pl.String, "paused": pl.Boolean, "next_slot_at": UTC_TS, "last_slot_at": UTC_TS,
    "last_run_id": pl.String, "last_run_status": pl.String, "missed_slots": pl.Int64, "skipped_slots": pl.Int64,
    "last_not_started_reason": pl.String, "buffered_slot_at": UTC_TS, "late": pl.Boolean, "late_reason": pl.String,
}
EVENT_SCHEMA = {
    "at": UTC_TS, "schedule": pl.String, "kind": pl.String, "source": pl.String, "first_slot_at": UTC_TS,
    "last_slot_at": UTC_TS, "slots": pl.Int64, "run_id": pl.String, "reason": pl.String,
}


def schedules_overview(source: Source = None, *, late_after_s: float = 300) -> pl.DataFrame:
    """Every schedule by name: next slot, last slot and its run (and that run's status),
    slots missed and skipped with the latest reason, and ``late`` when its last due slot
    did not start within ``late_after_s`` (:func:`~composer_ops.core.schedules.late_reason`)."""
    if not late_after_s >= 0:
        raise Invalid(f"late_after_s must be 0 or more seconds, got {late_after_s}")
    with connection(source) as conn:
        rows = schedules.summaries(conn)
    out = []
    for r in rows:
        why = late_reason(paused=r.paused, next_slot_at=r.next_slot_at, last_slot_at=r.last_slot_at,
                          last_missed_slot_at=r.last_missed_slot_at,
                          last_not_started_reason=r.last_not_started_reason, now=r.now,
                          threshold=timedelta(seconds=late_after_s), duration=duration)
        out.append((r.name, r.workflow_id, r.cron, r.timezone, r.overlap, r.catchup, r.paused, r.next_slot_at,
                    r.last_slot_at, r.last_run_id, r.last_run_status, r.missed_slots, r.skipped_slots,
                    r.last_not_started_reason, r.buffered_slot_at, why is not None, why))
    return rows_frame(out, OVERVIEW_SCHEMA)


def schedule_events(source: Source = None, *, limit: int = 50) -> pl.DataFrame:
    """The newest ``limit`` slot events of every schedule, newest first: runs started
    (cron, trigger, backfill), slots buffered, and runs of slots missed or skipped with why."""
    if limit < 1:
        raise Invalid(f"limit must be 1 or more, got {limit}")
    with connection(source) as conn:
        names = {r.id: r.name for r in schedules.summaries(conn)}
        rows = schedules.events(conn, limit=limit)
    return rows_frame([(e.at, names.get(e.schedule_id, f"(deleted {e.schedule_id})"), e.kind, e.source,
                        e.first_slot_at, e.last_slot_at, e.slots, e.run_id, e.reason) for e in rows], EVENT_SCHEMA)
