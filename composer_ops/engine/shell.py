"""The shell around the pure state machine: one transaction per event.

For each event: open a transaction, LoadRun (the run's row lock, and the database
clock in the same statement), ask the machine, apply its actions through the
repository, commit. A fenced update that matches zero rows means something changed
the task outside the engine: the transaction is rolled back, never committed with a
decision based on a wrong snapshot. Transient database errors retry the whole event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from composer_ops.core import (
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
    Stale,
    StartRun,
    TaskState,
    WorkflowSpec,
    decide,
    spec_from_json,
)
from composer_ops.db.errors import Pool
from composer_ops.db.retry import db_retry
from composer_ops.engine.ids import uuid7_text
from composer_ops.errors import Conflict
from composer_ops.repo import definitions, outbox, runs, signals, tasks, webhooks
from composer_ops.repo._base import Conn
from composer_ops.repo.rows import Dispatch, RunRow, TaskStateRow

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Definition:
    """A deployed version as the shell needs it; immutable, so cached forever."""

    workflow_id: str
    version: int
    spec: WorkflowSpec
    webhook_url: str | None


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What handling one event did."""

    run_id: str
    stale: str | None = None            # the reason, when the event changed nothing
    finished: RunStatus | None = None   # set when this event finished the run

    @property
    def applied(self) -> bool:
        return self.stale is None


class _Store:
    """The machine's reads, served in the event's transaction."""

    def __init__(self, conn: Conn, run_id: str) -> None:
        self._conn, self._run_id = conn, run_id

    def load_outputs(self, node_ids: Collection[str]) -> Mapping[str, Any]:
        return runs.load_outputs(self._conn, self._run_id, sorted(node_ids))

    def pending_signals(self, name: str) -> Sequence[Signal]:
        return signals.pending_signals(self._conn, self._run_id, name)


class Shell:
    """Applies events to runs; shared by the Engine, workers and coordinators."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._definitions: dict[tuple[str, int], Definition] = {}
        self._lock = threading.Lock()

    # -- definitions -------------------------------------------------------

    def definition(self, conn: Conn, workflow_id: str, version: int) -> Definition:
        key = (workflow_id, version)
        with self._lock:
            cached = self._definitions.get(key)
        if cached is not None:
            return cached
        row = definitions.get_version(conn, workflow_id, version)
        found = Definition(workflow_id=row.id, version=row.version, spec=spec_from_json(row.spec_json),
                           webhook_url=row.webhook_url)
        with self._lock:
            self._definitions[key] = found
        return found

    # -- events ------------------------------------------------------------

    @db_retry()
    def handle(self, run_id: str, make_event: Callable[[datetime], Event]) -> Outcome:
        """Apply one event to one run in one transaction, under the run's row lock."""
        with self.pool.connection() as conn, conn.transaction():
            row, tasks_of_run = runs.lock_and_load(conn, run_id)
            snapshot = self.snapshot(conn, row, tasks_of_run)
            event = make_event(row.now)
            decision = decide(snapshot, event, _Store(conn, run_id), uuid7_text)
            return self.apply(conn, snapshot, decision)

    def snapshot(self, conn: Conn, row: RunRow, tasks: Mapping[str, TaskStateRow]) -> RunSnapshot:
        """The machine's view of a locked run and its tasks (:func:`runs.lock_and_load`)."""
        defn = self.definition(conn, row.workflow_id, row.workflow_version)
        context = row.context or {}
        nodes = tasks
        return RunSnapshot(
            id=row.id, workflow_id=row.workflow_id, workflow_version=row.workflow_version,
            status=RunStatus(row.status),
            context=RunContext(input=context.get("input"), config=context.get("config") or {}),
            spec=defn.spec,
            nodes={node_id: NodeState(task_id=t.task_id, state=TaskState(t.state), attempt=t.attempt,
                                      branches=tuple(t.branches) if t.branches is not None else None,
                                      event_name=t.event_name, lease_owner=t.lease_owner,
                                      lease_expires_at=t.lease_expires_at)
                   for node_id, t in nodes.items()},
        )

    def start_decision(self, conn: Conn, row: RunRow) -> Outcome:
        """Create a just-inserted run's root tasks (the StartRun event)."""
        snapshot = self.snapshot(conn, row, {})   # just inserted: no tasks yet
        decision = decide(snapshot, StartRun(now=row.now), _Store(conn, row.id), uuid7_text)
        return self.apply(conn, snapshot, decision)

    # -- applying actions --------------------------------------------------

    def apply(self, conn: Conn, run: RunSnapshot, decision: Decision) -> Outcome:
        """Write the decision's actions in order; raise (rolling back) on a fence miss."""
        dispatches: list[Dispatch] = []
        finished: RunStatus | None = None
        for action in decision.actions:
            if isinstance(action, Stale):
                log.info("stale event on run %s: %s", run.id, action.reason,
                         extra={"action": "stale", "run_id": run.id})
                return Outcome(run_id=run.id, stale=action.reason)
            if isinstance(action, CreateTask):
                self._create(conn, run, action, dispatches)
            elif isinstance(action, CompleteTask):
                _fenced(tasks.complete_task(conn, action.ref, action.output), action)
            elif isinstance(action, FailTask):
                _fenced(tasks.fail_task(conn, action.ref, action.reason), action)
            elif isinstance(action, RequeueTask):
                nxt = _fenced(tasks.requeue_task(conn, action.ref, action.reason), action)
                node = run.spec.nodes[nxt.node_id]
                dispatches.append(Dispatch(run_id=run.id, task_id=nxt.task_id, attempt=nxt.attempt,
                                           queue=node.queue or "default", task_name=node.task or nxt.node_id,
                                           lease_s=_lease(node.lease_s), available_at=action.available_at))
            elif isinstance(action, ResolveWait):
                _fenced(signals.resolve_wait(conn, run.id, action.task_id, state=str(action.state),
                                             output=action.output, reason=action.reason) or None, action)
            elif isinstance(action, BufferSignal):
                signals.buffer_signal(conn, run.id, signal_id=uuid7_text(), name=action.name,
                                      payload=action.payload)
            elif isinstance(action, ConsumeSignal):
                _fenced(signals.consume_signal(conn, run.id, action.signal_id) or None, action)
            elif isinstance(action, CancelTasks):
                tasks.cancel_tasks(conn, run.id, action.task_ids, action.reason)
                outbox.delete_for_tasks(conn, run.id, action.task_ids)
            elif isinstance(action, FinishRun):
                self._finish(conn, run, action)
                finished = action.status
        outbox.enqueue(conn, dispatches)
        return Outcome(run_id=run.id, finished=finished)

    def _create(self, conn: Conn, run: RunSnapshot, a: CreateTask, dispatches: list[Dispatch]) -> None:
        node = run.spec.nodes[a.node_id]
        queue = (node.queue or "default") if a.node_type is NodeType.TASK else None
        inserted = tasks.insert_task(
            conn, run.id, task_id=a.task_id, node_id=a.node_id, node_type=str(a.node_type), queue=queue,
            state=str(a.state), input=a.input, output=a.output, error=a.error, branches=a.branches,
            wake_at=a.wake_at, event_name=a.event_name)
        if not inserted:
            raise Conflict(f"run {run.id}: node {a.node_id} already has a task; "
                           "the decision was based on a stale snapshot and was rolled back")
        if a.node_type is NodeType.TASK and a.state is TaskState.PENDING:
            dispatches.append(Dispatch(run_id=run.id, task_id=a.task_id, attempt=0, queue=queue or "default",
                                       task_name=node.task or a.node_id, lease_s=_lease(node.lease_s),
                                       available_at=a.available_at))

    def _finish(self, conn: Conn, run: RunSnapshot, a: FinishRun) -> None:
        if not runs.finish_run(conn, run.id, str(a.status), reason=a.reason, output=a.output):
            raise Conflict(f"run {run.id} finished concurrently; the decision was rolled back")
        log.info("run %s %s", run.id, a.status, extra={"action": "finish_run", "run_id": run.id})
        defn = self.definition(conn, run.workflow_id, run.workflow_version)
        if defn.webhook_url:
            webhooks.enqueue(conn, run.id, defn.webhook_url, {
                "run_id": run.id, "workflow_id": run.workflow_id, "workflow_version": run.workflow_version,
                "status": str(a.status), "output": a.output,
                "error": {"error": a.reason} if a.reason else None,
            })


def _lease(lease_s: float) -> int:
    return max(1, int(round(lease_s)))


def _fenced(result: Any, action: object) -> Any:
    """A fenced write that matched nothing: roll the whole event back."""
    if result is None:
        raise Conflict(f"fenced write matched no row ({type(action).__name__}); "
                       "the task changed outside the engine, the event was rolled back")
    return result
