"""Rows the repository returns: frozen, keyword-only dataclasses built with class_row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from composer_ops.core.attempts import HistoryRow


@dataclass(frozen=True, kw_only=True)
class RunRow:
    """The locked run row, with the database clock its event judges by (``repo.clock``).
    ``context`` is None when it was not read with the lock (:func:`repo.runs.load_context`
    reads it on first use)."""

    id: str
    workflow_id: str
    workflow_version: int
    status: str
    now: datetime
    context: Any = None
    parent_run_id: str | None = None     # a child run: its parent and the parent's SUB_WORKFLOW node
    parent_node_id: str | None = None


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
    timed_out: bool = False      # the lease ended at the attempt's start_to_close deadline


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
    items_total: int | None = None        # a MAP node: its counters (ItemCounts)
    items_started: int | None = None


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
    priority: int = 0            # the node's flow-control priority: higher is claimed first in its queue
    max_run_s: int | None = None  # the node's start_to_close_s: no lease of an attempt passes it
    start_within_s: float | None = None   # the node's schedule_to_start_s, from available_at
    ckey: str | None = None      # the concurrency key's value (core.flow.key_text), and its limit
    climit: int | None = None
    rkey: str | None = None      # the rate limit's key, per_s and burst
    rate_per_s: float | None = None
    rate_burst: int | None = None


@dataclass(frozen=True, kw_only=True)
class Unstarted:
    """A dispatch not claimed by its schedule_to_start deadline (``task_outbox.start_by``)."""

    run_id: str
    task_id: str
    attempt: int


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
    item_index: int | None = None        # a MAP item: its position in the node's items


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
    parent_run_id: str | None = None     # a child run: the run whose SUB_WORKFLOW node started it
    parent_node_id: str | None = None
    children: list[ChildRun] = field(default_factory=list)
    #: False: odd data, the run's definition version row is gone, so no event of the run
    #: can be decided (the run_investigation report flags it)
    definition_found: bool = True


@dataclass(frozen=True, kw_only=True)
class ChildRun:
    """A run a SUB_WORKFLOW node of another run started."""

    id: str
    node_id: str
    workflow_id: str
    status: str


@dataclass(frozen=True, kw_only=True)
class PartitionRow:
    table: str
    name: str
    month: str
    lower_bound: str
    upper_bound: str


@dataclass(frozen=True, kw_only=True)
class PendingChild:
    """A child delivery's row waiting to be applied (``child_deliveries``): the run whose
    decision wrote it and the run it is applied to."""

    run_id: str
    target_run_id: str

    @property
    def key(self) -> tuple[str, str]:
        return self.run_id, self.target_run_id


@dataclass(frozen=True, kw_only=True)
class DueWebhook:
    """A webhook delivery due to be sent, before the relay takes it."""

    run_id: str
    id: int


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
    reason: str                    # "too new" | "has active runs" | "has live children" | "past cut-off, ..."
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


@dataclass(frozen=True, kw_only=True)
class ParentRow:
    """A child run's parent as a retry of the child reads it (:func:`composer_ops.repo.runs.parent_of`)."""

    run_id: str
    node_id: str
    status: str | None                   # None: the parent is gone
    node_created_at: datetime | None     # its node's task's creation: which child it stands for
    node_state: str | None = None        # its node's task's state (WAITING: for its child's finish)


@dataclass(frozen=True, kw_only=True)
class QueueSetting:
    """A queue's row in ``queue_settings`` (sql/V003)."""

    queue: str
    paused: bool
    reason: str | None
    paused_at: datetime | None
    max_running: int             # 0: no limit
    updated_at: datetime


@dataclass(frozen=True, kw_only=True)
class QueueRow:
    """A queue as ``composer-ops queues list`` and ``check`` show it."""

    queue: str
    paused: bool
    reason: str | None
    paused_at: datetime | None
    paused_s: float | None       # how long it has been paused, by the database clock
    max_running: int
    depth: int                   # dispatches in the outbox, ready or delayed
    ready: int
    oldest_ready_s: float
    running: int
    slots: int                   # RUNNING attempts counted against max_running


@dataclass(frozen=True, kw_only=True)
class KeyAtLimit:
    """A concurrency key with as many attempts RUNNING as its limit, and tasks ready behind it."""

    queue: str
    key: str
    key_limit: int
    waiting: int
    oldest_waiting_s: float
    running: int


@dataclass(frozen=True, kw_only=True)
class RateWait:
    """A rate limit key with tasks ready: they wait for the bucket's tokens."""

    key: str
    waiting: int
    oldest_waiting_s: float
    per_s: float
    tokens: float | None         # None: no claim has used the bucket yet


@dataclass(frozen=True, kw_only=True)
class StartLatency:
    """A queue's schedule-to-start latency (task created to first claimed), in seconds."""

    queue: str
    claims: int
    p50_s: float
    p95_s: float
