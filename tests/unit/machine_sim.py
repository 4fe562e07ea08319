"""An in-memory stand-in for the database shell, for state machine tests.

``Sim`` holds a run the way the tables would (task rows, outputs, buffered signals),
serves the machine's ``Store`` reads, applies decisions with the same fences the
repository's SQL has, and checks the engine's invariants on every action. Used by
``test_machine`` (scenarios) and ``test_machine_properties`` (hypothesis).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from composer_ops.core.machine import decide
from composer_ops.core.model import (
    ACTIVE_RUN_STATUSES,
    ACTIVE_TASK_STATES,
    TERMINAL_TASK_STATES,
    BufferSignal,
    CancelTasks,
    CompleteTask,
    ConsumeSignal,
    CreateTask,
    Decision,
    Event,
    FailTask,
    FinishRun,
    NodeState,
    NodeType,
    RequeueTask,
    ResolveWait,
    RunContext,
    RunSnapshot,
    RunStatus,
    Signal,
    SignalReceived,
    StartRun,
    TaskCompleted,
    TaskFailed,
    TaskRef,
    TaskState,
    TimerDue,
)
from composer_ops.core.spec import WorkflowSpec, parse_spec

T0 = datetime(2026, 5, 17, 12, 0, tzinfo=UTC)


class Sim:
    """An in-memory run: the tables, the shell's apply step and invariant checks."""

    def __init__(self, spec: WorkflowSpec | Mapping[str, Any], *, input: Any = None, run_id: str = "run-1") -> None:
        self.spec = spec if isinstance(spec, WorkflowSpec) else parse_spec(spec)
        self.run_id = run_id
        self.status = RunStatus.RUNNING
        self.context = RunContext(input=input, config=self.spec.config)
        self.now = T0
        self.event_now = T0
        self.nodes: dict[str, NodeState] = {}
        self.node_types: dict[str, NodeType] = {}
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        self.errors: dict[str, str | None] = {}
        self.wake_at: dict[str, datetime | None] = {}
        self.available_at: dict[str, datetime | None] = {}
        self.signals: list[Signal] = []
        self.consumed: set[str] = set()
        self.run_output: Any = None
        self.run_reason: str | None = None
        self.loads: list[tuple[str, ...]] = []
        self.decisions: list[Decision] = []
        self._tasks = 0
        self._signals = 0

    # -- the Store the machine reads through ----------------------------------

    def load_outputs(self, node_ids: Collection[str]) -> Mapping[str, Any]:
        self.loads.append(tuple(sorted(node_ids)))
        assert len(set(node_ids)) == len(node_ids), "load_outputs asked twice for a node"
        return {
            n: self.outputs.get(n) for n in node_ids if n in self.nodes and self.nodes[n].state is TaskState.COMPLETED
        }

    def pending_signals(self, name: str) -> Sequence[Signal]:
        return [s for s in self.signals if s.name == name and s.id not in self.consumed]

    def new_id(self) -> str:
        self._tasks += 1
        return f"t{self._tasks:04d}"

    # -- the shell --------------------------------------------------------------

    def snapshot(self) -> RunSnapshot:
        return RunSnapshot(
            id=self.run_id,
            workflow_id=self.spec.id,
            workflow_version=1,
            status=self.status,
            context=self.context,
            spec=self.spec,
            nodes=dict(self.nodes),
        )

    def send(self, event: Event) -> Decision:
        decision = decide(self.snapshot(), event, self, self.new_id)
        self.event_now = event.now
        self.apply(decision)
        self.decisions.append(decision)
        return decision

    def apply(self, decision: Decision) -> None:
        if decision.stale:
            assert len(decision.actions) == 1, decision
            return
        assert self.status in ACTIVE_RUN_STATUSES, "a decision changed a finished run"
        for action in decision.actions:
            self._apply(action)
        if self.status not in ACTIVE_RUN_STATUSES:
            active = [n for n, s in self.nodes.items() if s.state in ACTIVE_TASK_STATES]
            assert not active, f"run {self.status} with active tasks {active}"

    def live(self, dep: str, node_id: str) -> bool:
        """The readiness rule, restated independently of the machine."""
        state = self.nodes[dep]
        dep_spec = self.spec.nodes[dep]
        ok = state.state is TaskState.COMPLETED or (state.state is TaskState.FAILED and dep_spec.optional)
        if ok and dep_spec.type is NodeType.SWITCH:
            return node_id in (state.branches or ())
        return ok

    def _fenced(self, ref: TaskRef) -> NodeState:
        state = self.nodes[ref.node_id]
        assert ref.run_id == self.run_id
        assert state.task_id == ref.task_id and state.attempt == ref.attempt
        assert state.state is TaskState.RUNNING, state
        return state

    def _apply(self, action: object) -> None:
        if isinstance(action, CreateTask):
            self._create(action)
        elif isinstance(action, RequeueTask):
            state = self._fenced(action.ref)
            self.nodes[action.ref.node_id] = dataclasses.replace(
                state, state=TaskState.PENDING, attempt=state.attempt + 1, lease_owner=None, lease_expires_at=None
            )
            self.errors[action.ref.node_id] = action.reason
            self.available_at[action.ref.node_id] = action.available_at
        elif isinstance(action, CompleteTask | FailTask):
            state = self._fenced(action.ref)
            done = TaskState.COMPLETED if isinstance(action, CompleteTask) else TaskState.FAILED
            self.nodes[action.ref.node_id] = dataclasses.replace(
                state, state=done, lease_owner=None, lease_expires_at=None
            )
            if isinstance(action, CompleteTask):
                self.outputs[action.ref.node_id] = action.output
            else:
                self.errors[action.ref.node_id] = action.reason
        elif isinstance(action, ResolveWait):
            state = self.nodes[action.node_id]
            assert state.task_id == action.task_id and state.state is TaskState.WAITING
            assert action.state in (TaskState.COMPLETED, TaskState.FAILED)
            self.nodes[action.node_id] = dataclasses.replace(state, state=action.state)
            self.outputs[action.node_id] = action.output
            self.errors[action.node_id] = action.reason
        elif isinstance(action, BufferSignal):
            self._signals += 1
            self.signals.append(Signal(id=f"s{self._signals:04d}", name=action.name, payload=action.payload))
        elif isinstance(action, ConsumeSignal):
            assert action.signal_id in {s.id for s in self.signals}
            assert action.signal_id not in self.consumed, "a signal consumed twice"
            self.consumed.add(action.signal_id)
        elif isinstance(action, CancelTasks):
            assert action.task_ids, "empty CancelTasks"
            by_task = {s.task_id: n for n, s in self.nodes.items()}
            for task_id in action.task_ids:
                node_id = by_task[task_id]
                assert self.nodes[node_id].state in ACTIVE_TASK_STATES
                self.nodes[node_id] = dataclasses.replace(
                    self.nodes[node_id], state=TaskState.CANCELLED, lease_owner=None, lease_expires_at=None
                )
        elif isinstance(action, FinishRun):
            assert self.status in ACTIVE_RUN_STATUSES, "run finished twice"
            if action.status is RunStatus.SUCCEEDED:
                assert set(self.nodes) == set(self.spec.nodes)
                assert all(s.state in TERMINAL_TASK_STATES for s in self.nodes.values())
            self.status = action.status
            self.run_output = action.output
            self.run_reason = action.reason
        else:
            raise AssertionError(f"unexpected action {action!r}")

    def _create(self, action: CreateTask) -> None:
        node = self.spec.nodes[action.node_id]
        assert action.node_id not in self.nodes, f"second task for node {action.node_id}"
        assert action.node_type is node.type
        for dep in node.depends_on:
            assert dep in self.nodes and self.nodes[dep].state in TERMINAL_TASK_STATES, (
                f"{action.node_id} created before its dependency {dep} finished"
            )
        skipped = bool(node.depends_on) and not any(self.live(d, node.id) for d in node.depends_on)
        assert (action.state is TaskState.SKIPPED) == skipped, (action, skipped)
        if not skipped:
            allowed = {
                NodeType.TASK: {TaskState.PENDING},
                NodeType.SWITCH: {TaskState.COMPLETED},
                NodeType.WAIT: {TaskState.WAITING, TaskState.FAILED},
                NodeType.WAIT_FOR_EVENT: {TaskState.WAITING, TaskState.COMPLETED},
            }[node.type]
            assert action.state in allowed, action
        if action.state is TaskState.PENDING:
            assert action.available_at == self.event_now
        self.nodes[action.node_id] = NodeState(
            task_id=action.task_id,
            state=action.state,
            branches=action.branches,
            awaited_signal=action.awaited_signal,
        )
        self.node_types[action.node_id] = action.node_type
        self.inputs[action.node_id] = action.input
        self.outputs[action.node_id] = action.output
        self.errors[action.node_id] = action.error
        self.wake_at[action.node_id] = action.wake_at
        self.available_at[action.node_id] = action.available_at

    # -- what workers, timers and clients do -----------------------------------

    def ref(self, node_id: str, owner: str | None = "w1") -> TaskRef:
        state = self.nodes[node_id]
        return TaskRef(
            task_id=state.task_id, run_id=self.run_id, node_id=node_id, attempt=state.attempt, lease_owner=owner
        )

    def claim(self, node_id: str, owner: str = "w1") -> TaskRef:
        """The worker's fenced claim statement: PENDING -> RUNNING with a lease."""
        state = self.nodes[node_id]
        assert state.state in (TaskState.PENDING, TaskState.QUEUED)
        available = self.available_at.get(node_id)
        assert available is None or available <= self.now, "claimed before its backoff elapsed"
        lease = timedelta(seconds=self.spec.nodes[node_id].lease_s)
        self.nodes[node_id] = dataclasses.replace(
            state, state=TaskState.RUNNING, lease_owner=owner, lease_expires_at=self.now + lease
        )
        return self.ref(node_id, owner)

    def complete(self, node_id: str, output: Any = None, owner: str = "w1") -> Decision:
        ref = self.claim(node_id, owner)
        return self.send(TaskCompleted(ref=ref, output=output, now=self.now))

    def fail(self, node_id: str, error: str = "boom", retryable: bool = True) -> Decision:
        ref = self.claim(node_id)
        return self.send(TaskFailed(ref=ref, error=error, retryable=retryable, now=self.now))

    def fire(self, node_id: str) -> Decision:
        return self.send(TimerDue(task_id=self.nodes[node_id].task_id, node_id=node_id, now=self.now))

    def signal(self, name: str, payload: Any = None) -> Decision:
        return self.send(SignalReceived(name=name, payload=payload, now=self.now))

    def start(self) -> Decision:
        return self.send(StartRun(now=self.now))

    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def state(self, node_id: str) -> TaskState | None:
        return self.nodes[node_id].state if node_id in self.nodes else None


def kinds(decision: Decision) -> list[str]:
    """A compact view of a decision: action class, with the node for task actions."""
    out: list[str] = []
    for a in decision.actions:
        if isinstance(a, CreateTask):
            out.append(f"Create {a.node_id} {a.state}")
        elif isinstance(a, CompleteTask | FailTask | RequeueTask):
            out.append(f"{type(a).__name__} {a.ref.node_id}")
        elif isinstance(a, ResolveWait):
            out.append(f"ResolveWait {a.node_id} {a.state}")
        elif isinstance(a, FinishRun):
            out.append(f"FinishRun {a.status}")
        else:
            out.append(type(a).__name__)
    return out


def wf(*nodes: dict[str, Any], config: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": "wf", "config": config or {}, "nodes": list(nodes)}


def task(node_id: str, *deps: str, **extra: Any) -> dict[str, Any]:
    return {"id": node_id, "type": "TASK", "task": f"do.{node_id}", "depends_on": list(deps), **extra}


