"""The values the state machine reasons about: states, the run snapshot, events, actions.

Every state is a ``StrEnum`` whose value is the exact text stored in PostgreSQL, so
rows can be mapped to and from these types without a translation table. Every
dataclass is frozen and keyword-only: a snapshot handed to the machine cannot be
changed behind its back, and call sites stay readable when fields are added.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    from composer_ops.core.spec import WorkflowSpec


class TaskState(StrEnum):
    """State of one task instance (one row of ``task_instances``)."""

    PENDING = "PENDING"
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    WAITING = "WAITING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    SKIPPED = "SKIPPED"
    CANCELLED = "CANCELLED"


#: A task that has not ended: the states the machine cancels with its run, and the
#: predicate of the partial index that counts a run's active tasks.
ACTIVE_TASK_STATES: frozenset[TaskState] = frozenset(
    {TaskState.PENDING, TaskState.QUEUED, TaskState.RUNNING, TaskState.WAITING}
)
#: A TASK attempt that has not ended: waiting for a worker (PENDING, QUEUED) or
#: running under a lease (RUNNING). A worker's result, a retry or a failure applies
#: only to a task in one of these; WAITING belongs to WAIT and WAIT_FOR_SIGNAL nodes,
#: which no worker runs, so it is active but never in flight.
IN_FLIGHT_TASK_STATES: frozenset[TaskState] = frozenset({TaskState.PENDING, TaskState.QUEUED, TaskState.RUNNING})
TERMINAL_TASK_STATES: frozenset[TaskState] = frozenset(
    {TaskState.COMPLETED, TaskState.FAILED, TaskState.SKIPPED, TaskState.CANCELLED}
)


class RunStatus(StrEnum):
    """Status of a workflow run (one row of ``workflow_runs``)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


ACTIVE_RUN_STATUSES: frozenset[RunStatus] = frozenset({RunStatus.PENDING, RunStatus.RUNNING})
TERMINAL_RUN_STATUSES: frozenset[RunStatus] = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


class NodeType(StrEnum):
    """Kind of a workflow node; stored in ``task_instances.node_type``."""

    TASK = "TASK"
    SWITCH = "SWITCH"
    WAIT = "WAIT"
    WAIT_FOR_SIGNAL = "WAIT_FOR_SIGNAL"
    MAP = "MAP"
    SUB_WORKFLOW = "SUB_WORKFLOW"


# ---------------------------------------------------------------------------
# The snapshot


@dataclass(frozen=True, kw_only=True)
class ItemCounts:
    """A MAP node's counters, kept on its own task row so that an item's event reads
    these four numbers and its own item, never the other items.

    Items ``0 .. started - 1`` have been dispatched, in item order; ``done`` of them
    completed and ``failed`` failed for good. The rest of the dispatched ones are in
    flight, at most the node's ``max_parallel``.
    """

    total: int
    started: int = 0
    done: int = 0
    failed: int = 0

    @property
    def finished(self) -> int:
        return self.done + self.failed

    @property
    def in_flight(self) -> int:
        return self.started - self.finished


@dataclass(frozen=True, kw_only=True)
class NodeState:
    """What the machine knows about the task of one reached node.

    ``attempt`` is 0-based: the number of re-queues so far, of which
    ``lease_expiries`` were lease expiries (the rest handler failures, which are what
    the retry policy counts). ``signal_name`` is the signal a WAIT_FOR_SIGNAL task waits
    for (column ``task_instances.signal_name``). ``created_at`` is when the row was
    inserted and ``wake_at`` when a WAITING task's timer fires, both by the database
    clock. Inputs and outputs are deliberately absent: they are loaded through the
    store only when a decision needs them.
    """

    task_id: str
    state: TaskState
    attempt: int = 0
    branches: tuple[str, ...] | None = None
    signal_name: str | None = None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    created_at: datetime | None = None
    wake_at: datetime | None = None
    lease_expiries: int = 0
    items: ItemCounts | None = None


@dataclass(frozen=True, kw_only=True)
class ItemState(NodeState):
    """One item's task of a MAP node (its ``index`` in the items list), as the store
    loads it for an event on that item; ``items`` is always None."""

    index: int


class NodeView(Protocol):
    """What the machine reads of a reached node: the fields of :class:`NodeState`.

    A snapshot holds NodeStates (the shell builds them from rows it loads); any
    object that has these fields serves, so an in-memory replay can hand the machine
    its task rows as they are. The machine only reads them.
    """

    @property
    def task_id(self) -> str: ...
    @property
    def state(self) -> TaskState: ...
    @property
    def attempt(self) -> int: ...
    @property
    def branches(self) -> tuple[str, ...] | None: ...
    @property
    def signal_name(self) -> str | None: ...
    @property
    def lease_owner(self) -> str | None: ...
    @property
    def lease_expires_at(self) -> datetime | None: ...
    @property
    def created_at(self) -> datetime | None: ...
    @property
    def wake_at(self) -> datetime | None: ...
    @property
    def lease_expiries(self) -> int: ...
    @property
    def items(self) -> ItemCounts | None: ...


@dataclass(frozen=True, kw_only=True)
class Signal:
    """A buffered, not yet consumed signal (one row of ``workflow_events``)."""

    id: str
    name: str
    payload: Any


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """The run's input and its definition's config: the roots of ``$.`` references."""

    input: Any
    config: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class RunSnapshot:
    """A run as loaded under its row lock: the machine's whole view of the world.

    ``nodes`` holds only the nodes that have a task row, keyed by node id.
    """

    id: str
    workflow_id: str
    workflow_version: int
    status: RunStatus
    context: RunContext
    spec: WorkflowSpec
    nodes: Mapping[str, NodeView]
    parent_run_id: str | None = None     # a child run: the run whose SUB_WORKFLOW node started it
    parent_node_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class TaskRef:
    """One execution attempt of a task; a result applies only when every field matches.

    ``lease_owner`` is the worker that claimed the attempt; ``None`` skips the owner
    check (for reports that do not come from a worker).
    """

    task_id: str
    run_id: str
    node_id: str
    attempt: int
    lease_owner: str | None = None


# ---------------------------------------------------------------------------
# Events. ``now`` is always the database clock read in the event's transaction.


@dataclass(frozen=True, kw_only=True)
class StartRun:
    """The run row was just inserted; create its root nodes."""

    now: datetime


@dataclass(frozen=True, kw_only=True)
class TaskCompleted:
    """A worker finished an attempt; ``output`` is the handler's JSON result."""

    ref: TaskRef
    output: Any
    now: datetime


@dataclass(frozen=True, kw_only=True)
class TaskFailed:
    """A worker's handler raised; ``retryable`` is false for ``NonRetryableError``."""

    ref: TaskRef
    error: str
    retryable: bool
    now: datetime


@dataclass(frozen=True, kw_only=True)
class LeaseExpired:
    """The lease sweeper found the attempt RUNNING past its lease; ``timed_out`` when the
    lease ended at the attempt's start_to_close deadline (a handler that ran too long)."""

    ref: TaskRef
    now: datetime
    timed_out: bool = False


@dataclass(frozen=True, kw_only=True)
class TimerDue:
    """The timer loop found a WAITING task whose ``wake_at`` has passed."""

    task_id: str
    node_id: str
    now: datetime


@dataclass(frozen=True, kw_only=True)
class SignalReceived:
    """A client signalled the run."""

    name: str
    payload: Any
    now: datetime


@dataclass(frozen=True, kw_only=True)
class CancelRun:
    """A client asked to cancel the run."""

    reason: str
    now: datetime


@dataclass(frozen=True, kw_only=True)
class RetryRun:
    """An operator asked to run a FAILED or CANCELLED run again: from ``from_nodes``
    (none: from the nodes that failed) and every node downstream of them; tasks that
    were cancelled when the run ended run again too. Completed upstream outputs are kept.
    ``parent_status``: a child run's parent's status as the caller read it (None: no
    parent, or it is gone); ``parent_child``: the child run its parent's node stands
    for now (None: the node has no task; :func:`composer_ops.core.rerun.child_left_to_parent`)."""

    from_nodes: tuple[str, ...] = ()
    now: datetime
    parent_status: str | None = None
    parent_child: str | None = None
    parent_waits: bool = False       # the parent's node still waits for that child's finish


@dataclass(frozen=True, kw_only=True)
class StartTimedOut:
    """The timer loop found the attempt's dispatch unclaimed past its schedule_to_start
    deadline (by the database clock)."""

    task_id: str
    attempt: int
    now: datetime


@dataclass(frozen=True, kw_only=True)
class ChildFinished:
    """The child run a SUB_WORKFLOW node started finished (``status``, with its
    ``output`` or ``error``); delivered to the parent under the parent's run lock.
    ``started`` False: the child could not be started (``error`` says why), so no run
    has its ID."""

    node_id: str
    child_run_id: str
    status: RunStatus
    output: Any = None
    error: str | None = None
    started: bool = True
    now: datetime


Event: TypeAlias = (
    StartRun | TaskCompleted | TaskFailed | LeaseExpired | TimerDue | SignalReceived | CancelRun | RetryRun
    | StartTimedOut
    | ChildFinished
)


# ---------------------------------------------------------------------------
# Actions: what the shell must write, in order, in the event's transaction.


@dataclass(frozen=True, kw_only=True)
class CreateTask:
    """Insert the task of a node that just became ready.

    TASK nodes start PENDING with ``available_at`` set (the shell writes the outbox
    row); SWITCH nodes and WAIT_FOR_SIGNAL nodes that consume a buffered signal are
    born COMPLETED; WAIT and waiting WAIT_FOR_SIGNAL nodes are born WAITING with
    ``wake_at``; skipped nodes are born SKIPPED; a WAIT whose ``until`` reference
    does not resolve to an instant is born FAILED with ``error``. A MAP node is born
    WAITING with its ``items`` counters (a ``CreateItems`` follows), COMPLETED with
    output ``[]`` for an empty list, or FAILED when its items are not a list.
    """

    task_id: str
    node_id: str
    node_type: NodeType
    state: TaskState
    queue: str | None = None
    input: Any = None
    output: Any = None
    error: str | None = None
    branches: tuple[str, ...] | None = None
    wake_at: datetime | None = None
    signal_name: str | None = None
    available_at: datetime | None = None
    items: ItemCounts | None = None


@dataclass(frozen=True, kw_only=True)
class RequeueTask:
    """Put an attempt back to PENDING as attempt+1, dispatchable at ``available_at``.

    ``lease_expired`` when the attempt's lease lapsed (no handler failed): the task's
    ``lease_expiries`` count goes up instead of the retry policy being consumed.
    """

    ref: TaskRef
    reason: str
    available_at: datetime
    lease_expired: bool = False


@dataclass(frozen=True, kw_only=True)
class CompleteTask:
    """Mark the attempt COMPLETED with its output and release its lease."""

    ref: TaskRef
    output: Any


@dataclass(frozen=True, kw_only=True)
class FailTask:
    """Mark the attempt FAILED for good and release its lease."""

    ref: TaskRef
    reason: str
    unclaimed: bool = False      # a dispatched attempt no worker claimed: its dispatch goes first


@dataclass(frozen=True, kw_only=True)
class ResolveWait:
    """Move a WAITING task to COMPLETED (with ``output``) or FAILED (with ``reason``).

    ``timer`` when its ``wake_at`` resolved it (a WAIT woke up, a WAIT_FOR_SIGNAL timed
    out), rather than a signal.
    """

    task_id: str
    node_id: str
    state: TaskState
    output: Any = None
    reason: str | None = None
    timer: bool = False


@dataclass(frozen=True, kw_only=True)
class BufferSignal:
    """Store a signal no node is waiting for yet, as ``signal_id`` (a node created
    later in the same decision may consume it by that id)."""

    signal_id: str
    name: str
    payload: Any


@dataclass(frozen=True, kw_only=True)
class ConsumeSignal:
    """Mark a buffered signal consumed (it resolved a node created in this decision)."""

    signal_id: str


@dataclass(frozen=True, kw_only=True)
class CancelTasks:
    """Move these active tasks to CANCELLED (and drop their outbox rows)."""

    task_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True, kw_only=True)
class FinishRun:
    """Move the run to a terminal status; ``output`` is set for SUCCEEDED runs."""

    status: RunStatus
    output: Any = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class ReopenRun:
    """Move a finished run (``status``, FAILED or CANCELLED) back to RUNNING, clearing
    its error, output and completion time: a retry, after its ``ResetTasks``."""

    status: RunStatus


@dataclass(frozen=True, kw_only=True)
class ResetTasks:
    """Remove the tasks of nodes that run again, while the run is still finished (the
    first action of a retry); the nodes are then as never reached, and the decision
    creates those that are ready once the run is reopened."""

    task_ids: tuple[str, ...]
    node_ids: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CreateItems:
    """Insert the item tasks of a MAP node just created WAITING (``parent``): item
    ``i`` gets ``task_ids[i]`` and handler input ``inputs[i]``, in ``state`` (PENDING,
    or CANCELLED when the same decision failed the run); the first ``dispatch`` items
    get their outbox rows now."""

    node_id: str
    parent: str
    task_ids: tuple[str, ...]
    inputs: tuple[Any, ...]
    state: TaskState
    dispatch: int
    available_at: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class DispatchItems:
    """Write the outbox rows of these never dispatched items of a MAP node (by index)."""

    node_id: str
    indexes: tuple[int, ...]
    available_at: datetime


@dataclass(frozen=True, kw_only=True)
class CountItems:
    """Set a WAITING MAP node's counters (on its own task row, ``parent``)."""

    node_id: str
    parent: str
    items: ItemCounts


@dataclass(frozen=True, kw_only=True)
class FinishMap:
    """Move a WAITING MAP node to COMPLETED (``output``: the item outputs in item
    order) or FAILED (``reason``)."""

    node_id: str
    parent: str
    state: TaskState
    output: Any = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class CancelItems:
    """Move the active items of a MAP node to CANCELLED (and drop their outbox rows)."""

    node_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class StartChild:
    """Start the child run of a SUB_WORKFLOW node just created WAITING, as
    ``child_run_id`` (deterministic from the run, the node and the instant it was
    created), in the same transaction, through the engine's start path."""

    node_id: str
    child_run_id: str
    workflow: str
    version: int | None
    input: Any


@dataclass(frozen=True, kw_only=True)
class CancelChild:
    """Cancel the child run of a SUB_WORKFLOW node (its parent is ending)."""

    node_id: str
    child_run_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class FinishChild:
    """Move a WAITING SUB_WORKFLOW node to COMPLETED (``output``: the child's) or
    FAILED (``reason``)."""

    node_id: str
    parent: str
    state: TaskState
    output: Any = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Stale:
    """The event changes nothing; a reported result is dropped and reported as stale.
    ``odd``: not a late or repeated event but odd data (a task for a node the run's
    definition does not have), which no retry or later event resolves."""

    reason: str
    odd: bool = False


Action: TypeAlias = (
    CreateTask
    | RequeueTask
    | CompleteTask
    | FailTask
    | ResolveWait
    | BufferSignal
    | ConsumeSignal
    | CancelTasks
    | FinishRun
    | ReopenRun
    | ResetTasks
    | CreateItems
    | DispatchItems
    | CountItems
    | FinishMap
    | CancelItems
    | StartChild
    | CancelChild
    | FinishChild
    | Stale
)


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The machine's answer to one event: actions to apply in order, in one transaction.

    A stale decision holds exactly one ``Stale`` action and nothing else. ``refused``
    says why a signal was not delivered although the decision changed the run: by
    the database clock a timeout had already finished the run when it arrived. The
    actions are applied and committed, then the caller is told the reason.
    """

    actions: tuple[Action, ...]
    refused: str | None = None

    @property
    def stale(self) -> bool:
        """True when the event was dropped without changing anything."""
        return any(isinstance(a, Stale) for a in self.actions)

    @property
    def finish(self) -> FinishRun | None:
        """The run's terminal transition, when this decision finishes the run."""
        for action in self.actions:
            if isinstance(action, FinishRun):
                return action
        return None
