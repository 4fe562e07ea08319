"""Throughput and latency from the database's own timestamps (one clock for both systems).

A *unit* is one piece of work with three instants, all ``now()`` of the transaction
that wrote them:

- Composer: a TASK row: ``created_at`` (the start or completion that created it),
  ``started_at`` (the claim), ``finished_at`` (the completion);
- Procrastinate: a job: its ``deferred``, ``started`` and ``succeeded`` events.

start-to-claim = started - created, claim-to-complete = finished - started. A
*transition* is a claim (PENDING -> RUNNING / todo -> doing) or a completion
(RUNNING -> COMPLETED / doing -> succeeded): two per unit.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg

COMPOSER_UNITS = """
    SELECT created_at, started_at, finished_at FROM task_instances WHERE node_type = 'TASK'
"""

PROCRASTINATE_UNITS = """
    SELECT min(at) FILTER (WHERE type = 'deferred') AS created_at,
           min(at) FILTER (WHERE type = 'started') AS started_at,
           min(at) FILTER (WHERE type = 'succeeded') AS finished_at
      FROM procrastinate_events GROUP BY job_id
"""

_STATS = """
WITH u AS ({units}), w AS (SELECT COALESCE(%(w0)s::timestamptz, '-infinity') AS w0,
                                  COALESCE(%(w1)s::timestamptz, 'infinity') AS w1)
SELECT count(*) AS total,
       count(u.finished_at) AS finished,
       count(*) FILTER (WHERE u.created_at >= w.w0 AND u.created_at < w.w1) AS created_in_window,
       count(*) FILTER (WHERE u.started_at >= w.w0 AND u.started_at < w.w1) AS claimed_in_window,
       count(*) FILTER (WHERE u.finished_at >= w.w0 AND u.finished_at < w.w1) AS finished_in_window,
       min(u.started_at) AS first_claim, max(u.finished_at) AS last_finish,
       percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (
           ORDER BY extract(epoch FROM u.started_at - u.created_at) * 1000)
           FILTER (WHERE u.started_at >= w.w0 AND u.started_at < w.w1) AS start_to_claim_ms,
       percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (
           ORDER BY extract(epoch FROM u.finished_at - u.started_at) * 1000)
           FILTER (WHERE u.finished_at IS NOT NULL AND u.started_at >= w.w0 AND u.started_at < w.w1)
           AS claim_to_complete_ms
  FROM u, w
"""


@dataclass
class UnitStats:
    total: int
    finished: int
    created_in_window: int
    claimed_in_window: int
    finished_in_window: int
    first_claim: datetime | None
    last_finish: datetime | None
    start_to_claim_p50_ms: float | None
    start_to_claim_p99_ms: float | None
    claim_to_complete_p50_ms: float | None
    claim_to_complete_p99_ms: float | None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("first_claim", "last_finish"):
            out[key] = out[key].isoformat() if out[key] else None
        return out


def unit_stats(url: str, units: str, window: tuple[datetime, datetime] | None = None) -> UnitStats:
    w0, w1 = window if window else (None, None)
    with psycopg.connect(url) as conn:
        row: Any = conn.execute(_STATS.format(units=units), {"w0": w0, "w1": w1}).fetchone()
    s2c = row[7] or [None, None]
    c2c = row[8] or [None, None]
    return UnitStats(total=row[0], finished=row[1], created_in_window=row[2], claimed_in_window=row[3],
                     finished_in_window=row[4], first_claim=row[5], last_finish=row[6],
                     start_to_claim_p50_ms=s2c[0], start_to_claim_p99_ms=s2c[1],
                     claim_to_complete_p50_ms=c2c[0], claim_to_complete_p99_ms=c2c[1])


def seconds(a: datetime | None, b: datetime | None) -> float:
    if a is None or b is None:
        return 0.0
    return max((b - a).total_seconds(), 1e-9)


def rate(count: int, elapsed_s: float) -> float:
    return count / elapsed_s if elapsed_s > 0 else 0.0


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (a figure a round could not measure,
    such as CPU per item of a window that finished none); None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
