"""Active tasks: what the engine is working on right now, and what is waiting.

Every task_instances query here filters on the active states, which is exactly the
predicate of the partial index ``idx_task_instances_run_active``: the planner reads
that small index (one per monthly partition) instead of the finished history, so the
cost follows the number of active tasks, not the size of the table. Ages are
measured against the database clock (``now()``), so they are right whatever the
session TimeZone or the client's clock.
"""

from __future__ import annotations

import polars as pl

from composer_ops.errors import Invalid
from composer_ops.ops._common import (
    ACTIVE_SQL,
    ACTIVE_STATES,
    COORDINATOR_QUEUE,
    UTC_TS,
    Source,
    connection,
    frame,
    scalar,
)

#: Age buckets of the histogram: (label, upper bound in seconds; None = unbounded).
AGE_BUCKETS: tuple[tuple[str, float | None], ...] = (
    ("< 1 min", 60), ("1-5 min", 300), ("5-15 min", 900), ("15-60 min", 3600),
    ("1-6 h", 6 * 3600), ("6-24 h", 86400), ("> 1 day", None),
)

# -- active_tasks -- the oldest active tasks, small columns only (partial index on state).
ACTIVE_TASKS_SQL = f"""
    SELECT t.run_id, t.id, t.node_id, t.node_type, COALESCE(t.queue, '{COORDINATOR_QUEUE}') AS queue,
           t.state, t.attempt, t.created_at, t.updated_at, t.wake_at, t.event_name,
           extract(epoch FROM now() - t.created_at)::float8 AS age_s
      FROM task_instances t
     WHERE t.state IN {ACTIVE_SQL}
     ORDER BY t.created_at, t.run_id, t.node_id
     LIMIT %(limit)s
"""

_ACTIVE_SCHEMA = {
    "run_id": pl.String, "task_id": pl.String, "node_id": pl.String, "node_type": pl.String,
    "queue": pl.String, "state": pl.String, "attempt": pl.Int64, "created_at": UTC_TS,
    "updated_at": UTC_TS, "wake_at": UTC_TS, "event_name": pl.String, "age_s": pl.Float64,
}

# -- active_by_group -- counts per state x queue x node type and the oldest task of
# each group, from one pass over the partial index.
ACTIVE_BY_GROUP_SQL = f"""
    WITH a AS MATERIALIZED (
        SELECT state, COALESCE(queue, '{COORDINATOR_QUEUE}') AS queue, node_type, created_at, run_id, node_id
          FROM task_instances
         WHERE state IN {ACTIVE_SQL})
    SELECT g.state, g.queue, g.node_type, g.tasks, o.created_at,
           extract(epoch FROM now() - o.created_at)::float8, o.run_id, o.node_id
      FROM (SELECT state, queue, node_type, count(*) AS tasks FROM a GROUP BY state, queue, node_type) g
      JOIN (SELECT DISTINCT ON (state, queue, node_type) state, queue, node_type, created_at, run_id, node_id
              FROM a ORDER BY state, queue, node_type, created_at, run_id, node_id) o
        USING (state, queue, node_type)
     ORDER BY g.state, g.queue, g.node_type
"""

# -- age_histogram -- active tasks per age bucket (time since created) and state.
AGE_HISTOGRAM_SQL = f"""
    SELECT width_bucket(extract(epoch FROM now() - created_at)::float8, %(bounds)s::float8[]) AS bucket,
           state, count(*) AS tasks
      FROM task_instances
     WHERE state IN {ACTIVE_SQL}
     GROUP BY 1, 2
"""

# -- active_run_count -- how many runs have at least one active task.
ACTIVE_RUN_COUNT_SQL = f"""
    SELECT count(DISTINCT run_id) FROM task_instances WHERE state IN {ACTIVE_SQL}
"""

# -- top_runs -- runs with the most active tasks; the run row is read by primary key.
TOP_RUNS_SQL = f"""
    SELECT a.run_id, r.workflow_definition_id, r.workflow_version, r.status, a.active_tasks,
           a.oldest_created_at, extract(epoch FROM now() - a.oldest_created_at)::float8 AS oldest_age_s
      FROM (SELECT run_id, count(*) AS active_tasks, min(created_at) AS oldest_created_at
              FROM task_instances
             WHERE state IN {ACTIVE_SQL}
             GROUP BY run_id
             ORDER BY count(*) DESC, min(created_at), run_id
             LIMIT %(limit)s) a
      LEFT JOIN LATERAL (SELECT workflow_definition_id, workflow_version, status
                           FROM workflow_runs WHERE id = a.run_id) r ON true
     ORDER BY a.active_tasks DESC, a.oldest_created_at, a.run_id
"""

# -- outbox_backlog -- dispatches not yet claimed, per queue. The outbox is a queue
# (rows are deleted at claim), so it is small and read whole.
OUTBOX_SQL = """
    SELECT queue, count(*) AS rows,
           count(*) FILTER (WHERE available_at <= now()) AS ready,
           count(*) FILTER (WHERE available_at > now()) AS delayed,
           min(available_at) AS oldest_available_at,
           COALESCE(max(extract(epoch FROM now() - available_at)) FILTER (WHERE available_at <= now()), 0)::float8
               AS oldest_ready_age_s,
           max(available_at) FILTER (WHERE available_at > now()) AS last_delayed_until,
           max(attempt) AS max_attempt
      FROM task_outbox
     GROUP BY queue
     ORDER BY queue
"""


def active_tasks(source: Source = None, *, limit: int = 200) -> pl.DataFrame:
    """The ``limit`` oldest active tasks (PENDING, QUEUED, RUNNING, WAITING) with their age in seconds."""
    if limit < 1:
        raise Invalid(f"limit must be 1 or more, got {limit}")
    with connection(source) as conn:
        return frame(conn, ACTIVE_TASKS_SQL, {"limit": limit}, _ACTIVE_SCHEMA)


def active_by_group(source: Source = None) -> pl.DataFrame:
    """Counts by state x queue x node type, with the oldest task of each group
    (its age, run and node): a group whose oldest task keeps getting older is stuck.
    Non-TASK nodes (decided by the coordinator) are listed under the queue
    ``(coordinator)``."""
    with connection(source) as conn:
        return frame(conn, ACTIVE_BY_GROUP_SQL, None, {
            "state": pl.String, "queue": pl.String, "node_type": pl.String, "tasks": pl.Int64,
            "oldest_created_at": UTC_TS, "oldest_age_s": pl.Float64, "oldest_run_id": pl.String,
            "oldest_node_id": pl.String,
        })


def age_histogram(source: Source = None) -> pl.DataFrame:
    """Active tasks per age bucket (time since the task was created) and state; every
    bucket x active state pair is present, with 0 when empty, in bucket order."""
    bounds = [float(upper) for _, upper in AGE_BUCKETS if upper is not None]
    with connection(source) as conn:
        counted = frame(conn, AGE_HISTOGRAM_SQL, {"bounds": bounds},
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
        return frame(conn, TOP_RUNS_SQL, {"limit": limit}, {
            "run_id": pl.String, "workflow_id": pl.String, "workflow_version": pl.Int64, "status": pl.String,
            "active_tasks": pl.Int64, "oldest_created_at": UTC_TS, "oldest_age_s": pl.Float64,
        })


def active_run_count(source: Source = None) -> int:
    """How many runs have at least one active task."""
    with connection(source) as conn:
        value = scalar(conn, ACTIVE_RUN_COUNT_SQL)
    return int(value or 0)


def outbox_backlog(source: Source = None) -> pl.DataFrame:
    """Dispatches waiting in the outbox per queue: ready now (a worker could claim
    them) versus delayed (retry backoff), the oldest ready age and the highest attempt."""
    with connection(source) as conn:
        return frame(conn, OUTBOX_SQL, None, {
            "queue": pl.String, "rows": pl.Int64, "ready": pl.Int64, "delayed": pl.Int64,
            "oldest_available_at": UTC_TS, "oldest_ready_age_s": pl.Float64,
            "last_delayed_until": UTC_TS, "max_attempt": pl.Int64,
        })
