"""The pure state machine: given a run snapshot and one event, decide the actions.

``decide`` performs no I/O and never reads a clock: ``event.now`` is the database clock
of the event's transaction, and its only reads go through the ``Store`` the shell
passes in, under the run's row lock. The claim is not an event: it needs no decision
and must not take the run lock (docs/architecture.md). Within one decision the machine
works on an overlay of the snapshot, so a SWITCH, the skips behind it and the join
after it settle in one event.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol

from composer_ops.core import children, mapnode, model, rerun, signals
from composer_ops.core.expressions import is_ref, parse_ref, referenced_nodes, resolve, resolve_ref
from composer_ops.core.instants import RANGE_TEXT, instant_in_range
from composer_ops.core.model import (
    ACTIVE_RUN_STATUSES,
    ACTIVE_TASK_STATES,
    TERMINAL_TASK_STATES,
    Decision,
    ItemState,
    NodeState,
    NodeType,
    NodeView,
    RunSnapshot,
    RunStatus,
    Signal,
    TaskRef,
    TaskState,
)
from composer_ops.core.retry import retry_decision
from composer_ops.core.spec import NodeSpec
from composer_ops.errors import Conflict

__all__ = ["Store", "decide"]


class Store(Protocol):
    """The reads a decision may need, served by the shell inside the event's transaction."""

    def load_outputs(self, node_ids: Collection[str]) -> Mapping[str, Any]:
        """Outputs of those of ``node_ids`` that are COMPLETED; others may be absent."""
        ...

    def pending_signals(self, name: str) -> Sequence[Signal]:
        """Unconsumed buffered signals of that name, oldest first."""
        ...

    def load_item(self, node_id: str, task_id: str) -> ItemState | None:
        """The item task ``task_id`` of MAP node ``node_id``; None when there is none."""
        ...

    def item_outputs(self, node_id: str) -> Sequence[Any]:
        """The outputs of a MAP node's items in item order (None for an item without one)."""
        ...


#: The fields of a node's task the machine reads (every ``NodeView`` property).
_NODE_FIELDS = tuple(f.name for f in dataclasses.fields(NodeState))


#: Sorts a node whose creation time is unknown before every known one.


def _seconds(value: float) -> str:
    return f"{int(value)}s" if float(value).is_integer() else f"{value}s"


def _instant(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        ts = datetime.fromisoformat(value)
    except ValueError:
        return None
    return ts if ts.tzinfo is not None and ts.utcoffset() is not None else None


def _stale(reason: str, *, odd: bool = False) -> Decision:
    return Decision(actions=(model.Stale(reason=reason, odd=odd),))


class Decider:
    """One decision in progress: the snapshot, the overlay and the actions so far."""

    def __init__(self, run: RunSnapshot, store: Store, new_id: Callable[[], str], now: datetime) -> None:
        self.run = run
        self.spec = run.spec
        self.store = store
        self.new_id = new_id
        self.now = now
        # Copy on write: a node's snapshot view until this decision changes it, then
        # the NodeState this decision gave it.
        self.slots: dict[str, NodeView] = dict(run.nodes)
        self.actions: list[model.Action] = []
        # Nodes created in this decision -> the index of their CreateTask in actions.
        self.created: dict[str, int] = {}
        self.refused: str | None = None
        # Outputs decided in this call (not yet in the database) or already loaded.
        self.outputs: dict[str, Any] = {}
        self.signals: dict[str, list[Signal]] = {}
        self.consumed: set[str] = set()
        self.finished = False
        # MAP items loaded in this decision, by task id.
        self.items: dict[str, ItemState] = {}

    def decision(self) -> Decision:
        return Decision(actions=tuple(self.actions), refused=self.refused)

    # -- reads --------------------------------------------------------------

    def outputs_of(self, node_ids: Iterable[str]) -> dict[str, Any]:
        """Outputs of the COMPLETED nodes among ``node_ids``, loading only what is unknown."""
        wanted = sorted({n for n in node_ids if n in self.slots and self.slots[n].state is TaskState.COMPLETED})
        missing = [n for n in wanted if n not in self.outputs]
        if missing:
            loaded = self.store.load_outputs(missing)
            for node_id in missing:
                self.outputs[node_id] = loaded.get(node_id)
        return {n: self.outputs[n] for n in wanted}

    def buffered(self, name: str) -> list[Signal]:
        """The buffered signals of that name, oldest first, including any this decision buffered."""
        if name not in self.signals:
            self.signals[name] = list(self.store.pending_signals(name))
        return self.signals[name]

    def take_signal(self, name: str) -> Signal | None:
        """The oldest buffered signal of that name not yet consumed in this decision."""
        for signal in self.buffered(name):
            if signal.id not in self.consumed:
                self.consumed.add(signal.id)
                return signal
        return None

    # -- writes -------------------------------------------------------------

    def update(self, node_id: str, **fields: Any) -> None:
        """Give the node's task these field values in the overlay (the snapshot is left as it is)."""
        view = self.slots[node_id]
        values = {name: getattr(view, name) for name in _NODE_FIELDS}
        values.update(fields)
        self.slots[node_id] = NodeState(**values)

    def set_state(self, node_id: str, state: TaskState, *, output: Any = None, **fields: Any) -> None:
        """Move the node's task to ``state``, its lease released, with ``fields`` changed too."""
        self.update(node_id, state=state, lease_owner=None, lease_expires_at=None, **fields)
        if state is TaskState.COMPLETED:
            self.outputs[node_id] = output

    def create(self, node: NodeSpec, state: TaskState, **fields: Any) -> None:
        task_id = self.new_id()
        self.created[node.id] = len(self.actions)
        self.actions.append(model.CreateTask(task_id=task_id, node_id=node.id, node_type=node.type, state=state,
                                             **fields))
        self.slots[node.id] = NodeState(
            task_id=task_id,
            state=state,
            branches=fields.get("branches"),
            signal_name=fields.get("signal_name"),
            created_at=self.now,
            wake_at=fields.get("wake_at"),
            items=fields.get("items"),
        )
        if state is TaskState.COMPLETED:
            self.outputs[node.id] = fields.get("output")

    def fail_run(self, reason: str) -> None:
        """Cancel every active task and finish the run FAILED.

        A task created earlier in this same decision is created CANCELLED instead: it
        never existed as active, so it gets no dispatch and no timer.
        """
        why = f"run failed: {reason}"
        active: list[str] = []
        for node_id, slot in self.slots.items():
            if slot.state not in ACTIVE_TASK_STATES:
                continue
            kind = self.spec.nodes[node_id].type if node_id in self.spec.nodes else None
            if kind is NodeType.MAP:
                mapnode.cancel_items(self, node_id, why)
            elif kind is NodeType.SUB_WORKFLOW:
                children.cancel_child(self, node_id, why)
            self.update(node_id, state=TaskState.CANCELLED)
            index = self.created.get(node_id)
            if index is None:
                active.append(slot.task_id)
                continue
            born = self.actions[index]
            assert isinstance(born, model.CreateTask)
            self.actions[index] = dataclasses.replace(born, state=TaskState.CANCELLED, error=why, wake_at=None,
                                                      available_at=None)
        if active:
            self.actions.append(model.CancelTasks(task_ids=tuple(sorted(active)), reason=why))
        self.actions.append(model.FinishRun(status=RunStatus.FAILED, output=None, reason=reason))
        self.finished = True

    def node_failed(self, node_id: str, reason: str) -> None:
        """A node failed for good: fail the run unless the node is optional."""
        if not self.spec.nodes[node_id].optional:
            self.fail_run(reason)

    # -- readiness ----------------------------------------------------------

    def live(self, dep: str, node_id: str) -> bool:
        """Whether a terminal dependency lets ``node_id`` run rather than be skipped."""
        slot = self.slots[dep]
        dep_spec = self.spec.nodes[dep]
        if slot.state is TaskState.COMPLETED:
            pass
        elif slot.state is TaskState.FAILED and dep_spec.optional:
            pass
        else:
            return False
        if dep_spec.type is NodeType.SWITCH:
            return node_id in (slot.branches or ())
        return True

    def advance(self) -> None:
        """Create every node that became ready, cascading to a fixpoint.

        One pass in topological order suffices: a node created terminal (SWITCH,
        SKIPPED, consumed signal) is seen by its dependents later in the same pass.
        """
        for node_id in self.spec.topological_order():
            if self.finished:
                return
            if node_id in self.slots:
                continue
            node = self.spec.nodes[node_id]
            deps = node.depends_on
            if any(d not in self.slots or self.slots[d].state not in TERMINAL_TASK_STATES for d in deps):
                continue
            if deps and not any(self.live(d, node_id) for d in deps):
                queue = node.queue if node.type is NodeType.TASK or node.type is NodeType.MAP else None
                self.create(node, TaskState.SKIPPED, queue=queue)
            elif node.type is NodeType.TASK:
                self.create_task(node)
            elif node.type is NodeType.SWITCH:
                self.create_switch(node)
            elif node.type is NodeType.WAIT:
                self.create_wait(node)
            elif node.type is NodeType.MAP:
                mapnode.create_map(self, node)
            elif node.type is NodeType.SUB_WORKFLOW:
                children.create_child(self, node)
            else:
                signals.create_waiter(self, node)
        self.finish_if_done()

    def finish_if_done(self) -> None:
        if self.finished:
            return
        for node_id in self.spec.nodes:
            slot = self.slots.get(node_id)
            if slot is None or slot.state not in TERMINAL_TASK_STATES:
                return
        sinks = self.spec.sinks()
        outputs = self.outputs_of(sinks)
        self.actions.append(
            model.FinishRun(
                status=RunStatus.SUCCEEDED,
                output={sink: outputs.get(sink) for sink in sinks},
                reason=None,
            )
        )
        self.finished = True

    # -- node creation ------------------------------------------------------

    def create_task(self, node: NodeSpec) -> None:
        outputs = self.outputs_of(referenced_nodes(node.input))
        self.create(
            node,
            TaskState.PENDING,
            queue=node.queue,
            input=resolve(node.input, self.run.context, outputs),
            available_at=self.now,
        )

    def create_switch(self, node: NodeSpec) -> None:
        assert node.expression is not None
        ref = parse_ref(node.expression)
        outputs = self.outputs_of([ref.node] if ref.node is not None else [])
        value = resolve_ref(ref, self.run.context, outputs)
        # Case labels are JSON object keys, so a non-string value is matched by its
        # JSON text: 1 -> "1", true -> "true", null -> "null".
        key = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        branches = tuple(node.cases.get(key, node.default))
        self.create(
            node,
            TaskState.COMPLETED,
            output={"value": value, "branches": list(branches)},
            branches=branches,
        )

    def create_wait(self, node: NodeSpec) -> None:
        if node.duration_s is not None:
            self.create(node, TaskState.WAITING, wake_at=self.now + timedelta(seconds=node.duration_s))
            return
        assert node.until is not None
        value: Any = node.until
        if is_ref(node.until):
            ref = parse_ref(node.until)
            outputs = self.outputs_of([ref.node] if ref.node is not None else [])
            value = resolve_ref(ref, self.run.context, outputs)
        wake_at = _instant(value)
        error = None
        if wake_at is None:
            error = (
                f"until {node.until} resolved to {json.dumps(value, default=str)}, "
                "which is not an ISO-8601 instant with a time zone"
            )
        elif not instant_in_range(wake_at):
            error = (
                f"until {node.until} resolved to {json.dumps(value, default=str)}, which is outside the "
                f"instants the database can store and read back ({RANGE_TEXT})"
            )
        if error is not None:
            self.create(node, TaskState.FAILED, error=error)
            self.node_failed(node.id, f"node {json.dumps(node.id)} failed: {error}")
            return
        self.create(node, TaskState.WAITING, wake_at=wake_at)

    # -- events -------------------------------------------------------------

    def task_of(self, ref: TaskRef) -> NodeView | None:
        """The task ``ref`` names: a node's own, or an item of a MAP node."""
        slot = self.slots.get(ref.node_id)
        if ref.node_id not in self.spec.nodes or slot is None:
            return None
        return slot if slot.task_id == ref.task_id else mapnode.item_of(self, ref)

    def odd_node(self, node_id: str) -> str:
        """Why an event for a task of node ``node_id``, which the run's definition does
        not have, changes nothing (odd data: :meth:`stale` marks its decision ``odd``)."""
        return (f"run {self.run.id} has a task for node {json.dumps(node_id)}, which its definition "
                f"{self.run.workflow_id} v{self.run.workflow_version} does not have: odd data, left as it is "
                f"(the run_investigation report shows it; cancel the run to end it)")

    def stale(self, node_id: str, reason: str) -> Decision:
        """A decision that changes nothing, ``reason`` why; odd data when the run's
        definition has no node ``node_id``."""
        return _stale(reason, odd=node_id not in self.spec.nodes)

    def fence(self, ref: TaskRef) -> str | None:
        """Why a worker's report for ``ref`` is stale, or None if it is current."""
        run = self.run
        if ref.run_id != run.id:
            return f"task {ref.task_id} belongs to run {ref.run_id}, not {run.id}"
        if ref.node_id not in self.spec.nodes:
            return self.odd_node(ref.node_id)
        slot = self.task_of(ref)
        if slot is None:
            return f"run {run.id} has no task {ref.task_id} for node {json.dumps(ref.node_id)}"
        if slot.attempt != ref.attempt:
            return f"attempt {ref.attempt} of task {ref.task_id} is stale: the task is at attempt {slot.attempt}"
        if slot.state is not TaskState.RUNNING:
            return f"task {ref.task_id} is {slot.state}, not RUNNING"
        if ref.lease_owner is not None and slot.lease_owner != ref.lease_owner:
            return f"task {ref.task_id} is leased to {slot.lease_owner}, not {ref.lease_owner}"
        return None

    def on_result(self, ref: TaskRef) -> str | None:
        """Fence a worker's result: the attempt must be current and its lease unexpired."""
        reason = self.fence(ref)
        if reason is not None:
            return reason
        task = self.task_of(ref)
        assert task is not None
        expires = task.lease_expires_at
        if expires is not None and expires <= self.now:
            return (
                f"lease of task {ref.task_id} attempt {ref.attempt} lapsed at {expires.isoformat()}; "
                "the lease sweeper retries it"
            )
        return None

    def task_completed(self, event: model.TaskCompleted) -> Decision:
        reason = self.on_result(event.ref)
        if reason is not None:
            return self.stale(event.ref.node_id, reason)
        self.actions.append(model.CompleteTask(ref=event.ref, output=event.output))
        item = self.task_of(event.ref)
        if isinstance(item, ItemState):
            mapnode.item_finished(self, item, event.ref.node_id, output=event.output)
        else:
            self.set_state(event.ref.node_id, TaskState.COMPLETED, output=event.output)
        self.advance()
        return self.decision()

    def task_failed(self, ref: TaskRef, error: str, retryable: bool) -> Decision:
        """A handler raised. The retry policy counts handler failures only: attempts
        that ended in a lease expiry are not among them."""
        node = self.spec.nodes[ref.node_id]
        slot = self.task_of(ref)
        assert slot is not None
        failures = ref.attempt - slot.lease_expiries      # handler failures before this one
        delay = retry_decision(node.retry, failures, retryable)
        if delay is not None:
            available_at = self.now + timedelta(seconds=delay)
            self.actions.append(model.RequeueTask(ref=ref, reason=error, available_at=available_at))
            if not isinstance(slot, ItemState):
                self.set_state(ref.node_id, TaskState.PENDING, attempt=slot.attempt + 1)
            return self.decision()
        self.actions.append(model.FailTask(ref=ref, reason=error))
        attempts = failures + 1
        tried = f"after {attempts} attempts" if attempts > 1 else "after 1 attempt"
        if isinstance(slot, ItemState):
            mapnode.item_finished(self, slot, ref.node_id, error=f"{tried}: {error}")
        else:
            self.set_state(ref.node_id, TaskState.FAILED)
            self.node_failed(ref.node_id, f"node {json.dumps(ref.node_id)} failed {tried}: {error}")
        self.advance()
        return self.decision()

    def lease_expired(self, event: model.LeaseExpired) -> Decision:
        """No handler failed, so the retry policy is not consumed: the task is re-queued
        as a new attempt, up to the node's ``max_lease_expiries``; one more fails it."""
        ref = event.ref
        reason = self.fence(ref)
        if reason is not None:
            return self.stale(ref.node_id, reason)
        slot = self.task_of(ref)
        assert slot is not None
        expires = slot.lease_expires_at
        if expires is None or expires > self.now:
            return _stale(f"lease of task {ref.task_id} has not expired")
        node = self.spec.nodes[ref.node_id]
        if event.timed_out:     # the handler outran start_to_close_s: a failure, per the retry policy
            return self.task_failed(ref, f"start_to_close timeout: attempt {ref.attempt} still running after "
                                         f"{node.flow.timeouts.start_to_close_s} s", retryable=True)
        lapsed = f"lease of {slot.lease_owner} expired at {expires.isoformat()}"
        expiries = slot.lease_expiries + 1
        if expiries <= node.max_lease_expiries:
            self.actions.append(model.RequeueTask(ref=ref, reason=lapsed, available_at=self.now, lease_expired=True))
            if not isinstance(slot, ItemState):
                self.set_state(ref.node_id, TaskState.PENDING, attempt=slot.attempt + 1, lease_expiries=expiries)
            return self.decision()
        times = "once" if expiries == 1 else f"{expiries} times"
        error = (f"lease expired {times} (max_lease_expiries is {node.max_lease_expiries}); "
                 f"last owner {slot.lease_owner}, whose lease expired at {expires.isoformat()}")
        self.actions.append(model.FailTask(ref=ref, reason=error))
        if isinstance(slot, ItemState):
            mapnode.item_finished(self, slot, ref.node_id, error=error)
        else:
            self.set_state(ref.node_id, TaskState.FAILED)
            self.node_failed(ref.node_id, f"node {json.dumps(ref.node_id)} failed: {error}")
        self.advance()
        return self.decision()

    def start_timed_out(self, task_id: str, attempt: int) -> Decision:
        """Not claimed by its schedule_to_start deadline: the task fails (no retry: its
        retry policy is for handlers that ran), and the node's failure decides the run."""
        node_id, slot = next(((n, s) for n, s in self.slots.items() if s.task_id == task_id), ("", None))
        if slot is None or slot.attempt != attempt or slot.state not in (TaskState.PENDING, TaskState.QUEUED):
            return _stale(f"task {task_id} attempt {attempt} is no longer waiting to start")
        ref = TaskRef(task_id=task_id, run_id=self.run.id, node_id=node_id, attempt=attempt)
        error = (f"schedule_to_start timeout: attempt {ref.attempt} not claimed within "
                 f"{self.spec.nodes[ref.node_id].flow.timeouts.schedule_to_start_s} s")
        self.actions.append(model.FailTask(ref=ref, reason=error, unclaimed=True))
        self.set_state(ref.node_id, TaskState.FAILED)
        self.node_failed(ref.node_id, f"node {json.dumps(ref.node_id)} failed: {error}")
        self.advance()
        return self.decision()

    def timer_due(self, event: model.TimerDue) -> Decision:
        slot = self.slots.get(event.node_id)
        node = self.spec.nodes.get(event.node_id)
        if node is None:
            return self.stale(event.node_id, self.odd_node(event.node_id))
        if slot is None or slot.task_id != event.task_id:
            return _stale(f"run {self.run.id} has no task {event.task_id} for node {json.dumps(event.node_id)}")
        if slot.state is not TaskState.WAITING:
            return _stale(f"task {event.task_id} is {slot.state}, not WAITING")
        if node.type is not NodeType.WAIT and node.type is not NodeType.WAIT_FOR_SIGNAL:
            return _stale(f"node {json.dumps(node.id)} is a {node.type} node and has no timer")
        self.wake(node)
        self.advance()
        return self.decision()

    def wake(self, node: NodeSpec) -> None:
        """Resolve a WAITING node as its timer does: a WAIT completes, a WAIT_FOR_SIGNAL
        times out (completing with null output or failing, per ``on_timeout``)."""
        slot = self.slots[node.id]
        if node.type is NodeType.WAIT or node.on_timeout == "continue":
            self.actions.append(
                model.ResolveWait(task_id=slot.task_id, node_id=node.id, state=TaskState.COMPLETED, timer=True))
            self.set_state(node.id, TaskState.COMPLETED, output=None)
            return
        after = f" after {_seconds(node.timeout_s)}" if node.timeout_s is not None else ""
        error = f"timed out waiting for signal {json.dumps(node.signal_name)}{after}"
        self.actions.append(
            model.ResolveWait(task_id=slot.task_id, node_id=node.id, state=TaskState.FAILED, reason=error, timer=True))
        self.set_state(node.id, TaskState.FAILED)
        self.node_failed(node.id, f"node {json.dumps(node.id)} failed: {error}")

    def cancel_run(self, event: model.CancelRun) -> Decision:
        run = self.run
        if run.status not in ACTIVE_RUN_STATUSES:
            raise Conflict(f"run {run.id} is {run.status}; it cannot be cancelled")
        active = sorted(s.task_id for s in self.slots.values() if s.state in ACTIVE_TASK_STATES)
        for node_id, slot in self.slots.items():
            node = self.spec.nodes.get(node_id)
            if node is not None and node.type is NodeType.MAP and slot.state in ACTIVE_TASK_STATES:
                self.actions.append(model.CancelItems(node_id=node_id, reason=event.reason))
            elif node is not None and node.type is NodeType.SUB_WORKFLOW and slot.state in ACTIVE_TASK_STATES:
                children.cancel_child(self, node_id, event.reason)
        if active:
            self.actions.append(model.CancelTasks(task_ids=tuple(active), reason=event.reason))
        self.actions.append(model.FinishRun(status=RunStatus.CANCELLED, output=None, reason=event.reason))
        return self.decision()


def decide(run: RunSnapshot, event: model.Event, store: Store, new_id: Callable[[], str]) -> Decision:
    """Decide what one event does to a run.

    ``new_id`` mints task and buffered-signal ids. The earliest waiter of a signal is
    the node created first by the database clock (``NodeState.created_at``; nodes
    created in one transaction share it and go by task id). Raises
    ``Conflict`` for a signal or cancel on a finished run and ``Invalid`` for a
    signal no node of the workflow waits for; every other event on a finished run,
    and every report from a stale attempt, yields a decision with a single
    ``Stale`` action.
    """
    if event.now.tzinfo is None or event.now.utcoffset() is None:
        raise ValueError(f"event.now must be timezone-aware, got {event.now!r}")
    decider = Decider(run, store, new_id, event.now)
    if isinstance(event, model.SignalReceived):
        return signals.signal_received(decider, event)
    if isinstance(event, model.CancelRun):
        return decider.cancel_run(event)
    if isinstance(event, model.RetryRun):
        return rerun.retry_run(decider, event)
    if run.status not in ACTIVE_RUN_STATUSES:
        return _stale(f"run {run.id} is {run.status}")
    if isinstance(event, model.StartRun):
        if run.nodes:
            return _stale(f"run {run.id} has already started")
        decider.advance()
        return decider.decision()
    if isinstance(event, model.TaskCompleted):
        return decider.task_completed(event)
    if isinstance(event, model.TaskFailed):
        reason = decider.on_result(event.ref)
        if reason is not None:
            return decider.stale(event.ref.node_id, reason)
        return decider.task_failed(event.ref, event.error, event.retryable)
    if isinstance(event, model.LeaseExpired):
        return decider.lease_expired(event)
    if isinstance(event, model.StartTimedOut):
        return decider.start_timed_out(event.task_id, event.attempt)
    if isinstance(event, model.ChildFinished):
        return children.child_finished(decider, event)
    return decider.timer_due(event)
