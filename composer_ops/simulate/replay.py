"""Runs replayed in memory through the pure state machine, on a simulated clock.

A :class:`Replay` holds one run as the tables hold it after the shell applied each
decision, serves the machine's ``Store`` reads, and applies its actions with the
repository's fences: a write the database would refuse raises ``Conflict``. It knows no
workflow rule; only what happens without a decision (a claim, a heartbeat) is here,
with its SQL's conditions. Events carry their own ``now``; rows and IDs take it. The
history backfill and the state machine's tests drive it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

from composer_ops.core import model
from composer_ops.core.machine import decide
from composer_ops.core.model import (
    ACTIVE_RUN_STATUSES,
    ACTIVE_TASK_STATES,
    IN_FLIGHT_TASK_STATES,
    TERMINAL_TASK_STATES,
    Decision,
    ItemState,
    NodeState,
    NodeType,
    RunContext,
    RunSnapshot,
    RunStatus,
    Signal,
    TaskRef,
    TaskState,
)
from composer_ops.core.spec import WorkflowSpec
from composer_ops.errors import Conflict

__all__ = ["Replay", "SignalRow", "TaskRow"]


@dataclass(slots=True, kw_only=True)
class TaskRow:
    """One row of ``task_instances`` as the repository leaves it.

    ``scheduled_at`` is not kept: the engine writes it equal to ``created_at``.
    ``available_at`` is the task's dispatch (its outbox row): set while it waits to be
    claimed, ``None`` once claimed or cancelled.
    """

    task_id: str
    node_id: str
    node_type: NodeType
    queue: str | None
    state: TaskState
    created_at: datetime
    updated_at: datetime
    attempt: int = 0
    input: Any = None
    output: Any = None
    error: str | None = None
    branches: tuple[str, ...] | None = None
    wake_at: datetime | None = None
    signal_name: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    completed_at: datetime | None = None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    lease_expiries: int = 0
    available_at: datetime | None = None
    items: model.ItemCounts | None = None    # a MAP node's counters
    index: int | None = None                 # a MAP item's position in its list


@dataclass(slots=True, kw_only=True)
class SignalRow:
    """One row of ``workflow_events``: a buffered signal, consumed or not."""

    id: str
    name: str
    payload: Any
    created_at: datetime
    consumed_at: datetime | None = None


def _counter_ids() -> Callable[[str, datetime], str]:
    counts = {"t": 0}

    def mint(kind: str, at: datetime) -> str:
        counts[kind] += 1
        return f"{kind}{counts[kind]:04d}"

    return mint


class Replay:
    """One run in memory: its rows, the machine's store, the shell's apply step.

    ``mint(kind, at)`` returns a new ID for a task or a buffered signal (``kind``
    ``"t"``: the machine mints both through ``new_id``) created at ``at``; IDs must
    sort in creation order, as UUIDv7 text does (waiters created at the same instant
    go by task ID). The default mints ``t0001``, ``t0002``, ...
    """

    def __init__(self, spec: WorkflowSpec, *, run_id: str = "run-1", input: Any = None, now: datetime,
                 workflow_version: int = 1, mint: Callable[[str, datetime], str] | None = None) -> None:
        if now.tzinfo is None or now.utcoffset() is None:
            raise ValueError(f"a replay's clock must be timezone-aware, got {now!r}")
        self.spec = spec
        self.run_id = run_id
        self.workflow_version = workflow_version
        self.context = RunContext(input=input, config=spec.config)
        self.now = now
        self.mint = mint or _counter_ids()
        # The run's row.
        self.status = RunStatus.RUNNING
        self.run_output: Any = None
        self.run_reason: str | None = None
        self.created_at = now
        self.completed_at: datetime | None = None
        # Its tasks (by node) and buffered signals (in creation order).
        self.rows: dict[str, TaskRow] = {}
        self.signals: list[SignalRow] = []
        self._by_task: dict[str, str] = {}
        # The MAP items of each node, in item order, and each item's row by task id.
        self.items: dict[str, list[TaskRow]] = {}
        self._items_by_task: dict[str, TaskRow] = {}
        # The child runs SUB_WORKFLOW nodes started and cancelled: (node, child run ID).
        self.children: list[model.StartChild] = []
        self.cancelled_children: list[tuple[str, str]] = []
        self._event_now = now
        self._current: RunSnapshot | None = None

    @property
    def nodes(self) -> dict[str, NodeState]:
        """The rows as the shell would load them for a snapshot, by node."""
        return {node_id: NodeState(task_id=row.task_id, state=row.state, attempt=row.attempt, branches=row.branches,
                                   signal_name=row.signal_name, lease_owner=row.lease_owner,
                                   lease_expires_at=row.lease_expires_at, created_at=row.created_at,
                                   wake_at=row.wake_at, lease_expiries=row.lease_expiries, items=row.items)
                for node_id, row in self.rows.items()}

    # -- the Store the machine reads through --------------------------------------

    def load_outputs(self, node_ids: Collection[str]) -> Mapping[str, Any]:
        rows = self.rows
        return {n: rows[n].output for n in node_ids if n in rows and rows[n].state is TaskState.COMPLETED}

    def pending_signals(self, name: str) -> Sequence[Signal]:
        return [Signal(id=s.id, name=s.name, payload=s.payload) for s in self.signals
                if s.name == name and s.consumed_at is None]

    def load_item(self, node_id: str, task_id: str) -> ItemState | None:
        row = self._items_by_task.get(task_id)
        if row is None or row.node_id != node_id or row.index is None:
            return None
        return ItemState(task_id=row.task_id, state=row.state, attempt=row.attempt, lease_owner=row.lease_owner,
                         lease_expires_at=row.lease_expires_at, created_at=row.created_at,
                         lease_expiries=row.lease_expiries, index=row.index)

    def item_outputs(self, node_id: str) -> Sequence[Any]:
        return [row.output for row in self.items.get(node_id, [])]

    def new_id(self) -> str:
        """A task ID for the event being decided (the machine's ``new_id``)."""
        return self.mint("t", self._event_now)

    # -- the shell -------------------------------------------------------------------

    def snapshot(self) -> RunSnapshot:
        """The run as the shell would load it now."""
        return RunSnapshot(id=self.run_id, workflow_id=self.spec.id, workflow_version=self.workflow_version,
                           status=self.status, context=self.context, spec=self.spec, nodes=dict(self.nodes))

    def send(self, event: model.Event) -> Decision:
        """Decide ``event`` and apply the decision; ``Conflict``/``Invalid`` from the
        machine (a signal or cancel the run refuses) change nothing."""
        self._event_now = event.now
        current = self._current
        if current is None or current.status is not self.status:
            # The machine reads the rows themselves (they have every NodeView field)
            # through a read-only view: they change only between decisions, so the
            # view is the snapshot for as long as the run's status holds.
            current = self._current = RunSnapshot(
                id=self.run_id, workflow_id=self.spec.id, workflow_version=self.workflow_version,
                status=self.status, context=self.context, spec=self.spec, nodes=MappingProxyType(self.rows))
        decision = decide(current, event, self, self.new_id)
        self.apply(decision, event.now)
        return decision

    def apply(self, decision: Decision, now: datetime) -> None:
        """Write a decision's actions in order, as the shell does in one transaction."""
        writers = _WRITERS
        for action in decision.actions:
            if writers[type(action)](self, action, now):
                return

    def _stale(self, a: model.Stale, now: datetime) -> bool:
        return True

    def _complete(self, a: model.CompleteTask, now: datetime) -> None:
        row = self._fenced(a.ref, a)
        row.output, row.completed_at = a.output, now
        self._finish_task(row, TaskState.COMPLETED, now)

    def _fail(self, a: model.FailTask, now: datetime) -> None:
        row = self._fenced(a.ref, a)
        row.error = a.reason
        self._finish_task(row, TaskState.FAILED, now)

    def _requeue(self, a: model.RequeueTask, now: datetime) -> None:
        row = self._fenced(a.ref, a)
        row.attempt += 1
        row.lease_expiries += a.lease_expired
        row.error, row.started_at, row.available_at = a.reason, None, a.available_at
        self._set_state(row, TaskState.PENDING, now)

    def _resolve(self, a: model.ResolveWait, now: datetime) -> None:
        row = self.rows[a.node_id]
        if row.task_id != a.task_id or row.state is not TaskState.WAITING:
            raise self._refused(a)
        row.output, row.error = a.output, a.reason
        row.completed_at = now if a.state is TaskState.COMPLETED else None
        self._finish_task(row, a.state, now)

    def _buffer(self, a: model.BufferSignal, now: datetime) -> None:
        self.signals.append(SignalRow(id=a.signal_id, name=a.name, payload=a.payload, created_at=now))

    def _cancel(self, a: model.CancelTasks, now: datetime) -> None:
        for task_id in a.task_ids:
            row = self.rows[self._by_task[task_id]]
            if row.state in ACTIVE_TASK_STATES:
                row.error, row.available_at = a.reason, None
                self._finish_task(row, TaskState.CANCELLED, now)

    def _finish_run(self, a: model.FinishRun, now: datetime) -> None:
        if self.status not in ACTIVE_RUN_STATUSES:
            raise Conflict(f"run {self.run_id} finished concurrently; the decision was rolled back")
        self.status, self.run_output, self.run_reason = a.status, a.output, a.reason
        self.completed_at = now

    def _reopen(self, a: model.ReopenRun, now: datetime) -> None:
        if self.status is not a.status:
            raise Conflict(f"run {self.run_id} is {self.status}, not {a.status}; the retry was rolled back")
        self.status, self.run_output, self.run_reason, self.completed_at = RunStatus.RUNNING, None, None, None

    def _reset(self, a: model.ResetTasks, now: datetime) -> None:
        for task_id, node_id in zip(a.task_ids, a.node_ids, strict=True):
            row = self.rows.get(node_id)
            if row is None or row.task_id != task_id:
                raise self._refused(a)
            del self.rows[node_id], self._by_task[task_id]
            for item in self.items.pop(node_id, []):
                del self._items_by_task[item.task_id]

    def _create_items(self, a: model.CreateItems, now: datetime) -> None:
        parent = self.rows.get(a.node_id)
        if parent is None or parent.task_id != a.parent or a.node_id in self.items:
            raise self._refused(a)
        queue = self.spec.nodes[a.node_id].queue or "default"
        done = now if a.state in TERMINAL_TASK_STATES else None
        rows = [TaskRow(task_id=task_id, node_id=a.node_id, node_type=NodeType.MAP, queue=queue, state=a.state,
                        created_at=now, updated_at=now, input=item, index=i, finished_at=done,
                        available_at=a.available_at if i < a.dispatch else None)
                for i, (task_id, item) in enumerate(zip(a.task_ids, a.inputs, strict=True))]
        self.items[a.node_id] = rows
        self._items_by_task.update((row.task_id, row) for row in rows)

    def _dispatch_items(self, a: model.DispatchItems, now: datetime) -> None:
        rows = self.items.get(a.node_id, [])
        for i in a.indexes:
            if not 0 <= i < len(rows) or rows[i].state is not TaskState.PENDING or rows[i].available_at is not None:
                raise self._refused(a)
            rows[i].available_at = a.available_at

    def _waiting_map(self, node_id: str, parent: str, action: object) -> TaskRow:
        row = self.rows.get(node_id)
        if row is None or row.task_id != parent or row.state is not TaskState.WAITING:
            raise self._refused(action)
        return row

    def _count_items(self, a: model.CountItems, now: datetime) -> None:
        row = self._waiting_map(a.node_id, a.parent, a)
        row.items, row.updated_at = a.items, now

    def _start_child(self, a: model.StartChild, now: datetime) -> None:
        if any(c.child_run_id == a.child_run_id for c in self.children):
            raise Conflict(f"workflow run {a.child_run_id} already exists")
        self.children.append(a)

    def _cancel_child(self, a: model.CancelChild, now: datetime) -> None:
        self.cancelled_children.append((a.node_id, a.child_run_id))

    def _finish_map(self, a: model.FinishMap | model.FinishChild, now: datetime) -> None:
        row = self._waiting_map(a.node_id, a.parent, a)
        row.output, row.error = a.output, a.reason
        row.completed_at = now if a.state is TaskState.COMPLETED else None
        self._finish_task(row, a.state, now)

    def _cancel_items(self, a: model.CancelItems, now: datetime) -> None:
        for row in self.items.get(a.node_id, []):
            if row.state in ACTIVE_TASK_STATES:
                row.error, row.available_at = a.reason, None
                self._finish_task(row, TaskState.CANCELLED, now)

    def _create(self, a: model.CreateTask, now: datetime) -> None:
        if a.node_id in self.rows:
            raise Conflict(f"run {self.run_id}: node {a.node_id} already has a task; "
                           "the decision was based on a stale snapshot and was rolled back")
        is_task = a.node_type is NodeType.TASK
        state = a.state
        self.rows[a.node_id] = TaskRow(
            task_id=a.task_id, node_id=a.node_id, node_type=a.node_type,
            queue=(self.spec.nodes[a.node_id].queue or "default") if is_task else None,
            state=state, created_at=now, updated_at=now, input=a.input, output=a.output, error=a.error,
            branches=a.branches, wake_at=a.wake_at, signal_name=a.signal_name,
            finished_at=now if state in TERMINAL_TASK_STATES else None,
            completed_at=now if state is TaskState.COMPLETED else None,
            available_at=a.available_at if is_task and state is TaskState.PENDING else None, items=a.items)
        self._by_task[a.task_id] = a.node_id

    def _consume(self, a: model.ConsumeSignal, now: datetime) -> None:
        for signal in self.signals:
            if signal.id == a.signal_id and signal.consumed_at is None:
                signal.consumed_at = now
                return
        raise self._refused(a)

    def _fenced(self, ref: TaskRef, action: object) -> TaskRow:
        """The row a fenced task update matches (id, node, attempt, an updatable state)."""
        row = self.rows.get(ref.node_id)
        if row is not None and row.task_id != ref.task_id:
            row = self._items_by_task.get(ref.task_id)
        if (row is None or ref.run_id != self.run_id or row.task_id != ref.task_id or row.node_id != ref.node_id
                or row.attempt != ref.attempt or row.state not in IN_FLIGHT_TASK_STATES):
            raise self._refused(action)
        return row

    @staticmethod
    def _refused(action: object) -> Conflict:
        return Conflict(f"fenced write matched no row ({type(action).__name__}); "
                        "the task changed outside the engine, the event was rolled back")

    def _finish_task(self, row: TaskRow, state: TaskState, now: datetime) -> None:
        row.finished_at = now
        self._set_state(row, state, now)

    def _set_state(self, row: TaskRow, state: TaskState, now: datetime) -> None:
        row.state, row.updated_at = state, now
        row.lease_owner = row.lease_expires_at = None

    # -- what workers do without a decision -------------------------------------------

    def claim(self, node_id: str, owner: str = "w1", *, item: int | None = None) -> TaskRef:
        """A worker's claim at ``now``: a dispatched PENDING task whose ``available_at``
        has come moves to RUNNING, leased to ``owner`` for the node's ``lease_s``;
        ``item``: that item of a MAP node."""
        row = self.rows.get(node_id) if item is None else self._item(node_id, item)
        if (row is None or row.state not in (TaskState.PENDING, TaskState.QUEUED) or row.available_at is None
                or row.available_at > self.now):
            raise Conflict(f"run {self.run_id}: node {node_id} has no task to claim at {self.now.isoformat()}")
        now = self.now
        row.state, row.started_at, row.updated_at, row.available_at = TaskState.RUNNING, now, now, None
        row.lease_owner = owner
        row.lease_expires_at = now + timedelta(seconds=self.spec.nodes[node_id].lease_s)
        return self.ref(node_id, owner, item=item)

    def _item(self, node_id: str, index: int) -> TaskRow | None:
        rows = self.items.get(node_id, [])
        return rows[index] if 0 <= index < len(rows) else None

    def heartbeat(self, node_id: str, owner: str) -> bool:
        """Extend ``owner``'s unexpired lease by the node's ``lease_s`` from ``now``;
        False when the lease is lost."""
        row = self.rows.get(node_id)
        if (row is None or row.state is not TaskState.RUNNING or row.lease_owner != owner
                or row.lease_expires_at is None or row.lease_expires_at <= self.now):
            return False
        row.lease_expires_at = self.now + timedelta(seconds=self.spec.nodes[node_id].lease_s)
        return True

    def ref(self, node_id: str, owner: str | None = "w1", *, item: int | None = None) -> TaskRef:
        """The reference of the node's current attempt (or of its item ``item``'s), as
        reported by ``owner``."""
        row = self.rows[node_id] if item is None else self.items[node_id][item]
        return TaskRef(task_id=row.task_id, run_id=self.run_id, node_id=node_id, attempt=row.attempt,
                       lease_owner=owner)

    def state(self, node_id: str) -> TaskState | None:
        """The node's task state, or None when it has no task."""
        row = self.rows.get(node_id)
        return None if row is None else row.state


#: How the shell writes each action, by its type; ``True`` ends the decision (stale).
_WRITERS: dict[type, Callable[[Replay, Any, datetime], bool | None]] = {
    model.Stale: Replay._stale, model.CreateTask: Replay._create, model.CompleteTask: Replay._complete,
    model.FailTask: Replay._fail, model.RequeueTask: Replay._requeue, model.ResolveWait: Replay._resolve,
    model.BufferSignal: Replay._buffer, model.ConsumeSignal: Replay._consume, model.CancelTasks: Replay._cancel,
    model.FinishRun: Replay._finish_run, model.ReopenRun: Replay._reopen, model.ResetTasks: Replay._reset,
    model.CreateItems: Replay._create_items, model.DispatchItems: Replay._dispatch_items,
    model.CountItems: Replay._count_items, model.FinishMap: Replay._finish_map,
    model.CancelItems: Replay._cancel_items, model.StartChild: Replay._start_child,
    model.CancelChild: Replay._cancel_child, model.FinishChild: Replay._finish_map}


def utc(epoch_s: float) -> datetime:
    """An epoch instant as an aware UTC datetime (the replay's clock type)."""
    return datetime.fromtimestamp(epoch_s, UTC)
