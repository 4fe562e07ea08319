"""Rows the repository returns: frozen, keyword-only dataclasses built with class_row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from composer_ops.core.attempts import HistoryRow


@dataclass(frozen=True, kw_only=True)
class RunRow:
    """The locked run row, with the database clock its event judges by (``repo.clock``)."""

    id: str
    workflow_id: str
    workflow_version: int
    status: str
    context: Any
    now: datetime


@dataclass(frozen=True, kw_only=True)
class TaskStateRow:
    """What lock_and_load reads per task: small columns only, no inputs or outputs."""

    node_id: str
    task_id: str
    state: str
    attempt: int
    branches: list[str] | None
    signal_name: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    created_at: datetime
    wake_at: datetime | None
    lease_expiries: int


@dataclass(frozen=True, kw_only=True)
class FinishedTask:
    node_type: str
    started_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class TaskDispatch:
    """What the next dispatch of a re-queued task needs."""

    task_id: str
    run_id: str
    node_id: str
    node_type: str
    queue: str
    attempt: int
    input: Any


@dataclass(frozen=True, kw_only=True)
class DueWait:
    run_id: str
    task_id: str
    node_id: str


@dataclass(frozen=True, kw_only=True)
class ExpiredLease:
    run_id: str
    task_id: str
    node_id: str
    attempt: int
    lease_owner: str | None


@dataclass(frozen=True, kw_only=True)
class NewTask:
    """One task row to insert (what a CreateTask action describes)."""

    task_id: str
    node_id: str
    node_type: str
    queue: str | None
    state: str
    input: Any = None
    output: Any = None
    error: str | None = None
    branches: Sequence[str] | None = None
    wake_at: datetime | None = None
    signal_name: str | None = None


@dataclass(frozen=True, kw_only=True)
class Dispatch:
    """One outbox row to write."""

    run_id: str
    task_id: str
    attempt: int
    queue: str
    task_name: str
    lease_s: int
    available_at: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class Claim:
    """A task a worker has just claimed: it holds the lease until lease_expires_at."""

    run_id: str
    task_id: str
    node_id: str
    attempt: int
    task_name: str
    queue: str
    input: Any
    lease_s: int
    lease_owner: str
    lease_expires_at: datetime


@dataclass(frozen=True, kw_only=True)
class DefinitionRow:
    id: str
    name: str
    version: int
    spec_json: Any
    created_by: str
    enabled: bool
    webhook_url: str | None
    deployed: bool
    deployed_at: datetime | None
    deleted_at: datetime | None
    created_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class StartTarget:
    """The definition version a start uses, without its spec."""

    id: str
    version: int
    enabled: bool
    deleted_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class TaskView:
    """A task as ``Engine.get_run`` shows it."""

    id: str
    node_id: str
    node_type: str
    queue: str | None
    state: str
    attempt: int
    input: Any
    output: Any
    error: Any
    branches: list[str] | None
    wake_at: datetime | None
    signal_name: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class HistoryEntry:
    """A row to append to a run's history (``run_history``); see ``repo.history``."""

    kind: str
    node_id: str | None = None
    task_id: str | None = None
    attempt: int | None = None
    worker: str | None = None
    detail: Any = None


@dataclass(frozen=True, kw_only=True)
class RunView:
    """A run as ``Engine.get_run`` shows it, with its history oldest first."""

    id: str
    workflow_id: str
    workflow_version: int
    status: str
    input: Any
    output: Any
    error: Any
    created_at: datetime
    updated_at: datetime
    completed_at: datetime | None
    tasks: list[TaskView] = field(default_factory=list)
    history: list[HistoryRow] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class PartitionRow:
    table: str
    name: str
    month: str
    lower_bound: str
    upper_bound: str


@dataclass(frozen=True, kw_only=True)
class WebhookDelivery:
    id: int
    run_id: str
    url: str
    payload: Any
    attempts: int


@dataclass(frozen=True, kw_only=True)
class RetentionMonth:
    """One month of the retention plan (``composer_retention_plan``)."""

    month: str                     # YYYYMM
    month_start: datetime
    month_end: datetime
    action: str                    # "drop" | "keep"
    reason: str                    # "too new" | "has active runs" | "past cut-off, no active runs"
    active_runs: int
    active_run_ids: list[str]      # the first 20
    partitions: list[str]          # one per table of composer_run_tables(), workflow_runs first
    rows: int
    bytes: int


@dataclass(frozen=True, kw_only=True)
class DeletedRun:
    """What ``Engine.delete_run`` did."""

    run_id: str
    status: str                   # the finished status the run keeps
    deleted_at: datetime
    already: bool                 # it was deleted before this call (nothing changed)
    webhooks_given_up: int = 0    # its delivery was still pending
    dispatches_dropped: int = 0


@dataclass(frozen=True, kw_only=True)
class AuditRow:
    """One operator action (``operator_audit``): when, what, on what, how much, who."""

    id: int
    at: datetime
    action: str
    target: str | None
    counts: Any
    detail: Any
    command: str | None
    client_host: str | None
    client_addr: str
    login_role: str
    db_role: str
    request: str | None
    command_id: str | None = None      # shared by every row one command wrote (sql/V001)


@dataclass(frozen=True, kw_only=True)
class WorkerRow:
    """A registered worker, judged by the database clock: ``state`` is 'live',
    'dead' (not seen for three heartbeat intervals) or 'stopped'; ``running`` counts
    the RUNNING tasks it holds leases on, ``expired`` those whose lease has lapsed."""

    id: str
    host: str
    pid: int
    queues: list[str]
    concurrency: int
    heartbeat_s: float
    started_at: datetime
    last_seen_at: datetime
    stopped_at: datetime | None
    state: str
    silent_s: float
    running: int
    expired: int


@dataclass(frozen=True, kw_only=True)
class LeaseRow:
    """A RUNNING task's lease, as the workers list shows what a worker holds."""

    lease_owner: str
    run_id: str
    task_id: str
    node_id: str
    attempt: int
    lease_expires_at: datetime | None
    expired: bool


@dataclass(frozen=True, kw_only=True)
class RunListRow:
    """A run as ``runs list`` shows it."""

    id: str
    workflow_id: str
    workflow_version: int
    status: str
    input: Any
    error: Any
    created_at: datetime
    completed_at: datetime | None
