"""The history rows of one event (``run_history``), as the shell collects them while it
applies a decision's actions (:mod:`composer_ops.engine.shell`)."""

from __future__ import annotations

from typing import Any

from composer_ops.core.model import (
    BufferSignal,
    CancelChild,
    CancelRun,
    ChildFinished,
    ConsumeSignal,
    Decision,
    Event,
    LeaseExpired,
    ResolveWait,
    RetryRun,
    SignalReceived,
    StartChild,
    TaskFailed,
)
from composer_ops.engine.requests import KEY_PREFIX, Request
from composer_ops.repo.rows import HistoryEntry

__all__ = ["EventNotes"]


class EventNotes:
    """The history rows of one event, in the order of its actions: the row that records
    the event itself (it carries what the caller gets back on a duplicate: ``finished``,
    ``refused``) and the rows of what else happened in the same decision (timeouts
    judged at a signal, buffered signals consumed by new nodes)."""

    def __init__(self, event: Event, decision: Decision, request: Request) -> None:
        self.event = event
        finish = decision.finish
        self.outcome: dict[str, Any] = {}
        if finish is not None:
            self.outcome["finished"] = str(finish.status)
        if decision.refused is not None:
            self.outcome["refused"] = decision.refused
        self.key = request.id[len(KEY_PREFIX):] if request.id.startswith(KEY_PREFIX) else None
        # A lease that lapsed at its start_to_close deadline is the handler's failure (the
        # retry policy counts it), so its row says failed, not lease expired.
        self.failure_kind = "lease_expired" if isinstance(event, LeaseExpired) and not event.timed_out else "failed"
        self.cancelled_tasks = 0
        #: why the decision cancelled tasks (the first reason given), and their nodes
        self.cancel_reason: str | None = None
        self.cancelled_nodes: set[str] = set()
        self.operator: dict[str, Any] = {"operator": request.operator} if request.operator else {}
        self.reset: tuple[str, ...] = ()       # the nodes a retry removed, to run again
        self.rows: list[HistoryEntry] = []
        self.recorded = False                  # the event's own row is among ``rows``

    def task_entry(self, kind: str, ref: Any, **detail: Any) -> HistoryEntry:
        """The event's own row, for a worker's report or a lease expiry (written with the
        task's fenced update in the event's one write rather than with the other rows)."""
        if isinstance(self.event, TaskFailed):
            detail["retryable"] = self.event.retryable
        return HistoryEntry(kind=kind, node_id=ref.node_id, task_id=ref.task_id, attempt=ref.attempt,
                            worker=ref.lease_owner, detail={**detail, **self.outcome} or None)

    def cancel(self, count: int, reason: str, nodes: list[str]) -> None:
        """``count`` active tasks (or MAP items) of ``nodes`` cancelled by the decision."""
        self.cancelled_tasks += count
        self.cancel_reason = self.cancel_reason or reason
        self.cancelled_nodes.update(nodes)

    def _signal(self, **detail: Any) -> dict[str, Any]:
        assert isinstance(self.event, SignalReceived)
        signal: dict[str, Any] = {"name": self.event.name}
        if self.key is not None:
            signal["key"] = self.key
        self.recorded = True
        return {**signal, **detail, **self.outcome}

    def resolved(self, a: ResolveWait) -> None:
        if not a.timer:
            self.rows.append(HistoryEntry(kind="signal", node_id=a.node_id, task_id=a.task_id,
                                          detail=self._signal()))
            return
        detail: dict[str, Any] = {"state": str(a.state)}
        if a.reason:
            detail["error"] = a.reason
        if isinstance(self.event, SignalReceived):
            detail["judged_at"] = "signal"      # overdue when the signal came: resolved as its timer would
        else:
            detail |= self.outcome
            self.recorded = True
        self.rows.append(HistoryEntry(kind="timer", node_id=a.node_id, task_id=a.task_id, detail=detail))

    def buffered(self, a: BufferSignal) -> None:
        self.rows.append(HistoryEntry(kind="signal", detail=self._signal(buffered=a.signal_id)))

    def child(self, a: StartChild | CancelChild) -> None:
        kind = "child_started" if isinstance(a, StartChild) else "child_cancelled"
        self.rows.append(HistoryEntry(kind=kind, node_id=a.node_id, detail={"child": a.child_run_id}))

    def consumed(self, a: ConsumeSignal, node_id: str | None) -> None:
        self.rows.append(HistoryEntry(kind="signal_consumed", node_id=node_id, detail={"signal": a.signal_id}))

    def entries(self) -> list[HistoryEntry]:
        """The rows to write once the actions are applied."""
        if isinstance(self.event, CancelRun):
            self.rows.append(HistoryEntry(kind="cancelled", detail={
                "reason": self.event.reason, "tasks": self.cancelled_tasks, **self.operator, **self.outcome}))
        elif isinstance(self.event, SignalReceived) and not self.recorded:
            self.rows.append(HistoryEntry(kind="signal", detail=self._signal()))   # refused
        elif isinstance(self.event, ChildFinished):
            self.rows.append(HistoryEntry(kind="child_finished", node_id=self.event.node_id, detail={
                "child": self.event.child_run_id, "status": str(self.event.status), **self.outcome}))
        elif isinstance(self.event, RetryRun):
            self.rows.append(HistoryEntry(kind="retried", detail={
                "from": list(self.event.from_nodes), "reset": list(self.reset), **self.operator, **self.outcome}))
        if not isinstance(self.event, CancelRun) and self.cancelled_tasks and self.cancel_reason is not None:
            # Tasks (or MAP items) the event cancelled as it failed the run, or as a MAP
            # node failed, after the event's own row: their nodes' attempts end here
            # (core/attempts.py).
            self.rows.append(HistoryEntry(kind="cancelled", detail={
                "reason": self.cancel_reason, "tasks": self.cancelled_tasks, "nodes": sorted(self.cancelled_nodes)}))
        return self.rows
