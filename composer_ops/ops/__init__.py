"""Operations analytics: read-only functions returning polars DataFrames.

The notebooks under ``notebooks/`` call these and draw them with plotly
(:mod:`composer_ops.ops.charts`). Each function takes ``source``: an open psycopg
connection, a libpq URL, or None (``COMPOSER_DATABASE_URL``, else the embedded
server). All time arithmetic uses the database clock. The statements themselves
live in :mod:`composer_ops.repo.analytics` and :mod:`composer_ops.repo.partitions`.
"""

from composer_ops.core.cutoff import Cutoff, parse_cutoff
from composer_ops.ops import anomalies, display
from composer_ops.ops._common import (
    ACTIVE_STATES,
    COORDINATOR_QUEUE,
    RUN_TABLES,
    ReadFrom,
    connection,
    db_now,
    read_from,
    snapshot,
)
from composer_ops.ops.active import (
    active_by_group,
    active_run_count,
    active_tasks,
    age_histogram,
    definition_mismatches,
    held_queues,
    keys_at_limit,
    long_waits,
    map_items,
    outbox_backlog,
    queue_overview,
    rate_limited,
    start_latency,
    starts_overdue,
    timers_overdue,
    top_runs,
)
from composer_ops.ops.display import SelfChecks, show_key_figures, table
from composer_ops.ops.investigation import (
    RunStory,
    definition_graph,
    gantt_rows,
    latest_run_id,
    map_disagreements,
    run_story,
    validate_run_id,
)
from composer_ops.ops.leases import (
    attempt_distribution,
    expired_running,
    expiry_buckets,
    lease_owners,
    odd_lease_counts,
    odd_lease_text,
    recent_requeues,
    running_leases,
    without_lease,
)
from composer_ops.ops.operator import (
    archived_run_story,
    audit_commands,
    audit_log,
    definition_spec,
    find_runs,
    unblock_command,
    workers_frame,
)
from composer_ops.ops.params import check_parameters
from composer_ops.ops.partitions import (
    decode_uuid7_bound,
    growth,
    lookahead,
    monthly_growth_rate,
    node_totals,
    partition_inventory,
    partition_nodes,
    partition_totals,
)
from composer_ops.ops.retention import plan_frame, resolve_cutoff, retention_plan
from composer_ops.ops.schedules import schedule_events, schedules_overview

__all__ = [
    "ACTIVE_STATES",
    "COORDINATOR_QUEUE",
    "RUN_TABLES",
    "Cutoff",
    "ReadFrom",
    "RunStory",
    "SelfChecks",
    "active_by_group",
    "active_run_count",
    "active_tasks",
    "age_histogram",
    "anomalies",
    "archived_run_story",
    "attempt_distribution",
    "audit_commands",
    "audit_log",
    "check_parameters",
    "connection",
    "db_now",
    "decode_uuid7_bound",
    "display",
    "definition_graph",
    "definition_mismatches",
    "definition_spec",
    "expired_running",
    "expiry_buckets",
    "find_runs",
    "gantt_rows",
    "growth",
    "latest_run_id",
    "lease_owners",
    "held_queues",
    "long_waits",
    "lookahead",
    "map_disagreements",
    "map_items",
    "monthly_growth_rate",
    "outbox_backlog",
    "keys_at_limit",
    "queue_overview",
    "rate_limited",
    "start_latency",
    "starts_overdue",
    "timers_overdue",
    "parse_cutoff",
    "node_totals",
    "partition_inventory",
    "partition_nodes",
    "partition_totals",
    "plan_frame",
    "read_from",
    "recent_requeues",
    "resolve_cutoff",
    "retention_plan",
    "run_story",
    "running_leases",
    "schedule_events",
    "schedules_overview",
    "show_key_figures",
    "snapshot",
    "table",
    "top_runs",
    "unblock_command",
    "validate_run_id",
    "without_lease",
    "odd_lease_counts",
    "odd_lease_text",
    "workers_frame",
]
