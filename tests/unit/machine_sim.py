"""The state machine's unit tests drive runs through ``Replay`` with every invariant checked.

:class:`Sim` is :class:`composer_ops.simulate.replay.Replay` (the in-memory tables and
the shell's apply step, with the repository's fences) plus, on every applied action,
assertions of the engine's invariants, and an oracle of the readiness rule written
independently of the machine; it records the store reads and decisions, and has the
shortcuts the scenarios use (a worker that claims and reports at once, a timer, a
client). Used by ``test_machine`` (scenarios) and ``test_machine_properties`` (hypothesis).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from composer_ops.core import model
from composer_ops.core.model import NodeType, RunStatus, TaskState
from composer_ops.core.spec import WorkflowSpec, parse_spec
from composer_ops.simulate.replay import Replay

T0 = datetime(2026, 5, 17, 12, 0, tzinfo=UTC)


class Sim(Replay):
    """A replayed run whose every action is checked against the engine's invariants."""

    def __init__(self, spec: WorkflowSpec | Mapping[str, Any], *, input: Any = None, run_id: str = "run-1") -> None:
        super().__init__(spec if isinstance(spec, WorkflowSpec) else parse_spec(spec), run_id=run_id, input=input,
                         now=T0)
        self.loads: list[tuple[str, ...]] = []
        self.decisions: list[model.Decision] = []
        self.minted = 0
        counter = self.mint

        def mint(kind: str, at: datetime) -> str:
            self.minted += kind == "t"
            return counter(kind, at)

        self.mint = mint

    @property
    def consumed(self) -> set[str]:
        return {s.id for s in self.signals if s.consumed_at is not None}

    def load_outputs(self, node_ids: Collection[str]) -> Mapping[str, Any]:
        self.loads.append(tuple(sorted(node_ids)))
        assert len(set(node_ids)) == len(node_ids), "load_outputs asked twice for a node"
        return super().load_outputs(node_ids)

    def send(self, event: model.Event) -> model.Decision:
        decision = super().send(event)
        self.decisions.append(decision)
        return decision

    def apply(self, decision: model.Decision, now: datetime) -> None:
        if decision.stale:
            assert len(decision.actions) == 1, decision
            return
        reopens = any(isinstance(a, model.ReopenRun) for a in decision.actions)
        assert self.status in model.ACTIVE_RUN_STATUSES or reopens, "a decision changed a finished run"
        for action in decision.actions:
            self._check(action, now)
            super().apply(model.Decision(actions=(action,)), now)
        if self.status not in model.ACTIVE_RUN_STATUSES:
            active = [n for n, s in self.nodes.items() if s.state in model.ACTIVE_TASK_STATES]
            active += [f"{r.node_id}[{r.index}]" for rows in self.items.values() for r in rows
                       if r.state in model.ACTIVE_TASK_STATES]
            assert not active, f"run {self.status} with active tasks {active}"

    def live(self, dep: str, node_id: str) -> bool:
        """The readiness rule, restated independently of the machine."""
        state = self.nodes[dep]
        dep_spec = self.spec.nodes[dep]
        ok = state.state is TaskState.COMPLETED or (state.state is TaskState.FAILED and dep_spec.optional)
        if ok and dep_spec.type is NodeType.SWITCH:
            return node_id in (state.branches or ())
        return ok

    def _check(self, action: object, now: datetime) -> None:
        """What must hold before ``action`` is applied (the repository's fences are Replay's)."""
        if isinstance(action, model.CreateTask):
            self._check_create(action, now)
        elif isinstance(action, model.RequeueTask | model.CompleteTask | model.FailTask):
            row = self._items_by_task.get(action.ref.task_id) or self.rows[action.ref.node_id]
            assert row.state is TaskState.RUNNING, action
        elif isinstance(action, model.CountItems):
            counts = action.items
            assert 0 <= counts.finished <= counts.started <= counts.total, counts
            assert counts.in_flight <= self.spec.nodes[action.node_id].max_parallel, counts
        elif isinstance(action, model.ResolveWait):
            assert action.state in (TaskState.COMPLETED, TaskState.FAILED)
        elif isinstance(action, model.BufferSignal):
            assert action.signal_id not in {s.id for s in self.signals}, "a signal buffered twice"
        elif isinstance(action, model.ConsumeSignal):
            assert action.signal_id in {s.id for s in self.signals}
            assert action.signal_id not in self.consumed, "a signal consumed twice"
        elif isinstance(action, model.CancelTasks):
            assert action.task_ids, "empty CancelTasks"
            by_task = {s.task_id: n for n, s in self.nodes.items()}
            assert all(self.nodes[by_task[t]].state in model.ACTIVE_TASK_STATES for t in action.task_ids)
        elif isinstance(action, model.ReopenRun):
            assert self.status is action.status and self.status in (RunStatus.FAILED, RunStatus.CANCELLED)
        elif isinstance(action, model.ResetTasks):
            assert action.node_ids and len(action.task_ids) == len(action.node_ids)
            assert self.status in (RunStatus.FAILED, RunStatus.CANCELLED), "reset the tasks of an open run"
            assert all(self.nodes[n].task_id == t and self.nodes[n].state in model.TERMINAL_TASK_STATES
                       for t, n in zip(action.task_ids, action.node_ids, strict=True)), "reset an active task"
        elif isinstance(action, model.FinishRun):
            assert self.status in model.ACTIVE_RUN_STATUSES, "run finished twice"
            if action.status is RunStatus.SUCCEEDED:
                assert set(self.nodes) == set(self.spec.nodes)
                assert all(s.state in model.TERMINAL_TASK_STATES for s in self.nodes.values())

    def _check_create(self, action: model.CreateTask, now: datetime) -> None:
        node = self.spec.nodes[action.node_id]
        assert action.node_id not in self.nodes, f"second task for node {action.node_id}"
        assert action.node_type is node.type
        for dep in node.depends_on:
            assert dep in self.nodes and self.nodes[dep].state in model.TERMINAL_TASK_STATES, (
                f"{action.node_id} created before its dependency {dep} finished"
            )
        skipped = bool(node.depends_on) and not any(self.live(d, node.id) for d in node.depends_on)
        assert (action.state is TaskState.SKIPPED) == skipped, (action, skipped)
        if not skipped:
            allowed = {
                NodeType.TASK: {TaskState.PENDING},
                NodeType.SWITCH: {TaskState.COMPLETED},
                NodeType.WAIT: {TaskState.WAITING, TaskState.FAILED},
                NodeType.WAIT_FOR_SIGNAL: {TaskState.WAITING, TaskState.COMPLETED},
                NodeType.MAP: {TaskState.WAITING, TaskState.COMPLETED, TaskState.FAILED},
                NodeType.SUB_WORKFLOW: {TaskState.WAITING},
            }[node.type]
            # A node created in the decision that fails the run is created CANCELLED.
            assert action.state in allowed | {TaskState.CANCELLED}, action
        if action.state is TaskState.PENDING:
            assert action.available_at == now

    # -- what workers, timers and clients do -----------------------------------

    def complete(self, node_id: str, output: Any = None, owner: str = "w1") -> model.Decision:
        ref = self.claim(node_id, owner)
        return self.send(model.TaskCompleted(ref=ref, output=output, now=self.now))

    def fail(self, node_id: str, error: str = "boom", retryable: bool = True) -> model.Decision:
        ref = self.claim(node_id)
        return self.send(model.TaskFailed(ref=ref, error=error, retryable=retryable, now=self.now))

    def fire(self, node_id: str) -> model.Decision:
        return self.send(model.TimerDue(task_id=self.nodes[node_id].task_id, node_id=node_id, now=self.now))

    def signal(self, name: str, payload: Any = None) -> model.Decision:
        return self.send(model.SignalReceived(name=name, payload=payload, now=self.now))

    def start(self) -> model.Decision:
        return self.send(model.StartRun(now=self.now))

    def retry(self, *from_nodes: str) -> model.Decision:
        return self.send(model.RetryRun(from_nodes=from_nodes, now=self.now))

    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def kinds(decision: model.Decision) -> list[str]:
    """A compact view of a decision: action class, with the node for task actions."""
    out: list[str] = []
    for a in decision.actions:
        if isinstance(a, model.CreateTask):
            out.append(f"Create {a.node_id} {a.state}")
        elif isinstance(a, model.CompleteTask | model.FailTask | model.RequeueTask):
            out.append(f"{type(a).__name__} {a.ref.node_id}")
        elif isinstance(a, model.ResolveWait):
            out.append(f"ResolveWait {a.node_id} {a.state}")
        elif isinstance(a, model.FinishRun):
            out.append(f"FinishRun {a.status}")
        else:
            out.append(type(a).__name__)
    return out


def wf(*nodes: dict[str, Any], config: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": "wf", "config": config or {}, "nodes": list(nodes)}


def task(node_id: str, *deps: str, **extra: Any) -> dict[str, Any]:
    return {"id": node_id, "type": "TASK", "task": f"do.{node_id}", "depends_on": list(deps), **extra}


