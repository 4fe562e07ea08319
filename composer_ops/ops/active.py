"""Active tasks: what the engine is working on right now, and what is waiting.

Every task_instances query here filters on the active states, which is exactly the
predicate of the partial index ``idx_task_instances_run_active``: the planner reads
that small index (one per monthly partition) instead of the finished history, so the
cost follows the number of active tasks, not the size of the table. Ages are
measured against the database clock (``now()``), so they are right whatever the
session TimeZone or the client's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import polars as pl

from composer_ops.core.runids import run_id_bound
from composer_ops.errors import Invalid
from composer_ops.ops._common import ACTIVE_STATES, UTC_TS, Schema, Source, connection, db_now, rows_frame
from composer_ops.repo import analytics, queues

#: Age buckets of the histogram: (label, upper bound in seconds; None = unbounded).
AGE_BUCKETS: tuple[tuple[str, float | None], ...] = (
    ("< 1 min", 60), ("1-5 min", 300), ("5-15 min", 900), ("15-60 min", 3600),
    ("1-6 h", 6 * 3600), ("6-24 h", 86400), ("> 1 day", None),
)

_ACTIVE_SCHEMA = {
    "run_id": pl.String, "task_id": pl.String, "node_id": pl.String, "node_type": pl.String,
    "queue": pl.String, "state": pl.String, "attempt": pl.Int64, "created_at": UTC_TS,
    "updated_at": UTC_TS, "wake_at": UTC_TS, "signal_name": pl.String, "age_s": pl.Float64,
}

def active_tasks(source: Source = None, *, limit: int = 200) -> pl.DataFrame:
    """The ``limit`` oldest active tasks (PENDING, QUEUED, RUNNING, WAITING) with their age in seconds."""
    if limit < 1:
        raise Invalid(f"limit must be 1 or more, got {limit}")
    with connection(source) as conn:
        return rows_frame(analytics.active_tasks(conn, limit), _ACTIVE_SCHEMA)


def active_by_group(source: Source = None) -> pl.DataFrame:
    """Counts by state x queue x node type, with the oldest task of each group
    (its age, run and node): a group whose oldest task keeps getting older is stuck.
    Non-TASK nodes (decided by the coordinator) are listed under the queue
    ``(coordinator)``."""
    with connection(source) as conn:
        return rows_frame(analytics.active_by_group(conn), {
            "state": pl.String, "queue": pl.String, "node_type": pl.String, "tasks": pl.Int64,
            "oldest_created_at": UTC_TS, "oldest_age_s": pl.Float64, "oldest_run_id": pl.String,
            "oldest_node_id": pl.String,
        })


def age_histogram(source: Source = None) -> pl.DataFrame:
    """Active tasks per age bucket (time since the task was created) and state; every
    bucket x active state pair is present, with 0 when empty, in bucket order."""
    bounds = [float(upper) for _, upper in AGE_BUCKETS if upper is not None]
    with connection(source) as conn:
        counted = rows_frame(analytics.age_histogram(conn, bounds),
                             {"bucket_order": pl.Int64, "state": pl.String, "tasks": pl.Int64})
    labels = [label for label, _ in AGE_BUCKETS]
    grid = pl.DataFrame({
        "bucket_order": [i for i in range(len(labels)) for _ in ACTIVE_STATES],
        "bucket": [label for label in labels for _ in ACTIVE_STATES],
        "state": [s for _ in labels for s in ACTIVE_STATES],
    }, schema={"bucket_order": pl.Int64, "bucket": pl.String, "state": pl.String})
    return (grid.join(counted, on=["bucket_order", "state"], how="left")
            .with_columns(pl.col("tasks").fill_null(0))
            .sort("bucket_order", "state"))


def top_runs(source: Source = None, *, limit: int = 10) -> pl.DataFrame:
    """The runs with the most active tasks (a fan-out that never drains shows here)."""
    if limit < 1:
        raise Invalid(f"limit must be 1 or more, got {limit}")
    with connection(source) as conn:
        return rows_frame(analytics.top_runs(conn, limit), {
            "run_id": pl.String, "workflow_id": pl.String, "workflow_version": pl.Int64, "status": pl.String,
            "active_tasks": pl.Int64, "oldest_created_at": UTC_TS, "oldest_age_s": pl.Float64,
        })


def map_items(source: Source = None) -> pl.DataFrame:
    """Active MAP items per queue: ``running``; ``dispatched`` (in the outbox, waiting for
    a worker, or for a retry's backoff); ``held`` (not dispatched yet: their MAP node
    already has ``max_parallel`` items in flight); and how many ``runs`` they belong to.
    The items are also counted in :func:`active_by_group` (node type MAP)."""
    with connection(source) as conn:
        found = rows_frame(analytics.map_items(conn), {
            "queue": pl.String, "running": pl.Int64, "pending": pl.Int64, "held": pl.Int64, "runs": pl.Int64})
    return found.select("queue", "running", (pl.col("pending") - pl.col("held")).alias("dispatched"), "held", "runs")


def active_run_count(source: Source = None) -> int:
    """How many runs have at least one active task."""
    with connection(source) as conn:
        return analytics.active_run_count(conn)


def outbox_backlog(source: Source = None) -> pl.DataFrame:
    """Dispatches waiting in the outbox per queue: ready now (a worker could claim
    them) versus delayed (retry backoff), the oldest ready age and the highest attempt."""
    with connection(source) as conn:
        return rows_frame(analytics.outbox_backlog(conn), {
            "queue": pl.String, "rows": pl.Int64, "ready": pl.Int64, "delayed": pl.Int64,
            "oldest_available_at": UTC_TS, "oldest_ready_age_s": pl.Float64,
            "last_delayed_until": UTC_TS, "max_attempt": pl.Int64,
        })


def held_queues(queue_rows: pl.DataFrame) -> list[str]:
    """The queues of :func:`queue_overview` whose ready dispatches no claim takes now, on
    purpose: paused, or with as many tasks RUNNING as their ``max_running``. Their rows
    waiting in the outbox are not stuck, and no worker would take them."""
    return sorted(queue_rows.filter(pl.col("paused") | pl.col("at_limit"))["queue"].to_list())


def long_waits(source: Source = None, *, older_than_s: float = 86400, limit: int = 50) -> tuple[pl.DataFrame, int]:
    """WAIT_FOR_SIGNAL tasks with no timeout that have waited longer than ``older_than_s``
    (oldest first, at most ``limit``) and how many there are in all. Such a node waits
    for ever unless its signal comes: usually the signal was never sent, or was sent
    under another name or to another run."""
    if older_than_s < 0 or limit < 1:
        raise Invalid(f"long_waits needs older_than_s >= 0 and limit >= 1, got {older_than_s} and {limit}")
    with connection(source) as conn:
        rows = analytics.long_waits(conn, older_than_s, limit)
    total = int(rows[0][-1]) if rows else 0
    return rows_frame([r[:-1] for r in rows], {
        "run_id": pl.String, "task_id": pl.String, "node_id": pl.String, "signal_name": pl.String,
        "created_at": UTC_TS, "waiting_s": pl.Float64,
    }), total


def timers_overdue(source: Source = None, *, older_than_s: float = 60,
                   limit: int = 50) -> tuple[pl.DataFrame, int, int]:
    """WAITING tasks of active runs whose timer (``wake_at``: a WAIT node's timer, a
    WAIT_FOR_SIGNAL node's timeout) has passed, most overdue first (at most ``limit``),
    how many are overdue in all, and how many by more than ``older_than_s``. The
    coordinator's timer loop fires them within a pass: minutes overdue mean no
    coordinator is running, or its passes fail."""
    if older_than_s < 0 or limit < 1:
        raise Invalid(f"timers_overdue needs older_than_s >= 0 and limit >= 1, got {older_than_s} and {limit}")
    with connection(source) as conn:
        rows = analytics.timers_overdue(conn, older_than_s, limit)
    return _with_totals(rows, {
        "run_id": pl.String, "task_id": pl.String, "node_id": pl.String, "node_type": pl.String,
        "wake_at": UTC_TS, "overdue_s": pl.Float64,
    })


def starts_overdue(source: Source = None, *, older_than_s: float = 60,
                   limit: int = 50) -> tuple[pl.DataFrame, int, int]:
    """Dispatches still in the outbox past their schedule_to_start deadline (``start_by``),
    most overdue first (at most ``limit``), how many in all, and how many by more than
    ``older_than_s``. The coordinator's timer loop fails their tasks within a pass, as it
    fires :func:`timers_overdue`'s timers."""
    if older_than_s < 0 or limit < 1:
        raise Invalid(f"starts_overdue needs older_than_s >= 0 and limit >= 1, got {older_than_s} and {limit}")
    with connection(source) as conn:
        rows = analytics.starts_overdue(conn, older_than_s, limit)
    return _with_totals(rows, {
        "run_id": pl.String, "task_id": pl.String, "start_by": UTC_TS, "overdue_s": pl.Float64,
    })


def _with_totals(rows: Sequence[Sequence[Any]], schema: Schema) -> tuple[pl.DataFrame, int, int]:
    """Rows whose last two columns are the totals over every row (overdue, and overdue by
    more than the threshold: the same on each row), as the frame of the others and the totals."""
    overdue, late = (int(rows[0][-2]), int(rows[0][-1])) if rows else (0, 0)
    return rows_frame([r[:-2] for r in rows], schema), overdue, late


#: Columns of :func:`definition_mismatches`; ``node_id`` is null on a run's own row.
DEFINITION_MISMATCH_SCHEMA = {
    "run_id": pl.String, "workflow_id": pl.String, "workflow_version": pl.Int64, "status": pl.String,
    "node_id": pl.String, "node_type": pl.String, "tasks": pl.Int64, "states": pl.String,
    "oldest_created_at": UTC_TS, "oldest_age_s": pl.Float64,
}


def definition_mismatches(source: Source = None, *, limit: int = 50) -> tuple[pl.DataFrame, int]:
    """Active work its run's definition does not explain, oldest first (at most ``limit``
    rows), and how many rows there are in all: a run with active tasks whose definition
    version row is missing (one row, ``node_id`` null), and a run's active tasks for a
    node its definition version does not have (one row per node; a MAP node's items count
    as its tasks), and a run's active tasks whose run row is gone (one row, ``status`` and
    ``node_id`` null). :func:`composer_ops.ops.anomalies.definitions` turns them into anomalies.
    Only active rows are read (the partial index), so a run with no active task is not
    listed here: the run investigation flags it."""
    if limit < 1:
        raise Invalid(f"limit must be 1 or more, got {limit}")
    with connection(source) as conn:
        rows = analytics.definition_mismatches(conn, limit)
    total = int(rows[0][-1]) if rows else 0
    return rows_frame([r[:-1] for r in rows], DEFINITION_MISMATCH_SCHEMA), total


def queue_overview(source: Source = None) -> pl.DataFrame:
    """Every queue with a setting, a dispatch or a RUNNING task: paused (why, since when,
    for how long), its limit (``max_running``, 0: none) and whether it is at it, the
    dispatches waiting (``depth``, ``ready`` now, the oldest ready one's age) and the
    RUNNING tasks; ages by the database clock. A queue at its limit with ready
    dispatches is held back on purpose, not stuck."""
    with connection(source) as conn:
        found = queues.overview(conn, db_now(conn))
    frame = rows_frame([tuple(r.__dict__.values()) for r in found], {
        "queue": pl.String, "paused": pl.Boolean, "reason": pl.String, "paused_at": UTC_TS,
        "paused_s": pl.Float64, "max_running": pl.Int64, "depth": pl.Int64, "ready": pl.Int64,
        "oldest_ready_s": pl.Float64, "running": pl.Int64, "slots": pl.Int64})
    return frame.with_columns(
        at_limit=(pl.col("max_running") > 0) & (pl.col("slots") >= pl.col("max_running")))


def keys_at_limit(source: Source = None) -> pl.DataFrame:
    """Concurrency keys at their limit with tasks ready behind them (per queue): those
    tasks wait on purpose until an attempt of their key ends."""
    with connection(source) as conn:
        return rows_frame([tuple(r.__dict__.values()) for r in queues.keys_at_limit(conn, db_now(conn))], {
            "queue": pl.String, "key": pl.String, "key_limit": pl.Int64, "waiting": pl.Int64,
            "oldest_waiting_s": pl.Float64, "running": pl.Int64})


def rate_limited(source: Source = None) -> pl.DataFrame:
    """Rate limit keys with tasks ready: how many wait, the oldest's age, the rate and the
    bucket's tokens when a claim last looked."""
    with connection(source) as conn:
        return rows_frame([tuple(r.__dict__.values()) for r in queues.rate_limited(conn, db_now(conn))], {
            "key": pl.String, "waiting": pl.Int64, "oldest_waiting_s": pl.Float64, "per_s": pl.Float64,
            "tokens": pl.Float64})


def start_latency(source: Source = None, *, window_s: float = 3600) -> pl.DataFrame:
    """Per queue, how long tasks waited from creation to their first claim (p50, p95)
    over the last ``window_s`` seconds, for runs started in that window (their months
    only are read)."""
    if not window_s > 0:
        raise Invalid(f"window_s must be more than 0 seconds, got {window_s}")
    with connection(source) as conn:
        since = db_now(conn) - timedelta(seconds=window_s)
        found = queues.start_latency(conn, since=since, floor=run_id_bound(since))
    return rows_frame([tuple(r.__dict__.values()) for r in found], {
        "queue": pl.String, "claims": pl.Int64, "p50_s": pl.Float64, "p95_s": pl.Float64})
