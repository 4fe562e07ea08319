"""One run of the past, replayed through the state machine on a simulated clock.

:func:`play` drives a :class:`~composer_ops.simulate.replay.Replay` with the events the
real processes would have sent, at instants drawn from the seed: the machine decides
every state change; this module says only when things happen (queueing, heartbeats,
worker crashes at ``crash_rate`` and the sweeper finding them, timer delays, signals by
the run's plan, cancellations) and how attempts end. Events at one instant keep the
order they were scheduled in.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from composer_ops.core import model
from composer_ops.core.model import Decision, NodeType, RunStatus, TaskRef, TaskState
from composer_ops.errors import Conflict
from composer_ops.simulate.definitions import SignalPlan
from composer_ops.simulate.model import AttemptDraw, Behaviour, draw_attempt, task_output
from composer_ops.simulate.replay import Replay, utc

__all__ = ["Plan", "play", "stop_stuck"]

#: A worker's result reaches the database this long after its handler returns.
REPORT_S = 0.004
#: The longest a dispatched task waits for a free worker.
MAX_QUEUEING_S = 2.0
#: The lease owner of attempts whose worker lives to report.
_SURVIVOR = "sim-worker"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a run meets from the outside: its signals and maybe a cancellation
    (seconds after its start, and the reason)."""

    signals: tuple[SignalPlan, ...] = ()
    cancel: tuple[float, str] | None = None


@dataclass
class _Clock:
    """The pending events of one run, earliest first."""

    queue: list[tuple[float, int, str, Any]] = field(default_factory=list)
    seq: int = 0

    def at(self, when: float, kind: str, payload: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (when, self.seq, kind, payload))


def play(replay: Replay, rng: random.Random, behaviour: Behaviour, plan: Plan, start: float) -> None:
    """Play the run from ``start`` (epoch seconds) until it finishes or nothing more
    happens to it (a wait without timeout whose signal never comes)."""
    _Player(replay, rng, behaviour, plan).run(start)


class _Player:
    """One run's events: each kind's handler acts at its instant and may return the
    decision it caused, whose consequences :meth:`follow` schedules."""

    def __init__(self, replay: Replay, rng: random.Random, behaviour: Behaviour, plan: Plan) -> None:
        self.replay, self.rng, self.behaviour = replay, rng, behaviour
        self.clock = _Clock()
        # Late and too-late signals, sent once a node waits for their name.
        self.awaiting: dict[str, list[SignalPlan]] = {}
        self.plan = plan
        self.handlers: dict[str, Callable[[float, datetime, Any], Decision | None]] = {
            "start": self.start, "claim": self.claim, "heartbeat": self.heartbeat, "report": self.report,
            "expire": self.expire, "timer": self.timer, "signal": self.signal, "cancel": self.cancel}

    def run(self, start: float) -> None:
        replay, clock = self.replay, self.clock
        clock.at(start, "start")
        for signal in self.plan.signals:
            if signal.timing == "early":
                clock.at(start + signal.delay_s, "signal", (signal, False))
            elif signal.timing in ("late", "too_late"):
                self.awaiting.setdefault(signal.name, []).append(signal)
        if self.plan.cancel is not None:
            clock.at(start + self.plan.cancel[0], "cancel", self.plan.cancel[1])
        queue, handlers, pop, last = clock.queue, self.handlers, heapq.heappop, start
        while queue and replay.status is RunStatus.RUNNING:
            when, _, kind, payload = pop(queue)
            assert when >= last, f"{kind} scheduled at {when}, before the clock ({last})"
            last = when
            replay.now = now = datetime.fromtimestamp(when, UTC)
            decision = handlers[kind](when, now, payload)
            if decision is not None:
                self.follow(when, decision)

    def send(self, event: model.Event) -> Decision | None:
        """Send a client's event; None when the run refuses it (finished)."""
        try:
            return self.replay.send(event)
        except Conflict:
            return None

    def follow(self, when: float, decision: Decision) -> None:
        """Schedule what the decision sets in motion: dispatches, timers, awaited signals."""
        clock, rng = self.clock, self.rng
        for action in decision.actions:
            if isinstance(action, model.CreateTask):
                if action.state is TaskState.PENDING and action.available_at is not None:
                    clock.at(action.available_at.timestamp() + self.queueing(), "claim", (action.node_id, 0))
                elif action.state is TaskState.WAITING:
                    if action.wake_at is not None:   # an instant already past is due at once
                        clock.at(max(action.wake_at.timestamp(), when) + rng.uniform(0.01, 0.5), "timer",
                                 (action.node_id, action.task_id))
                    if action.node_type is NodeType.WAIT_FOR_SIGNAL and action.signal_name is not None:
                        for signal in self.awaiting.pop(action.signal_name, ()):
                            clock.at(when + signal.delay_s, "signal", (signal, False))
            elif isinstance(action, model.RequeueTask):
                clock.at(action.available_at.timestamp() + self.queueing(), "claim",
                         (action.ref.node_id, action.ref.attempt + 1))

    def queueing(self) -> float:
        return min(self.rng.lognormvariate(-4.2, 0.8), MAX_QUEUEING_S)

    # -- events, by kind ------------------------------------------------------------

    def start(self, when: float, now: datetime, payload: None) -> Decision | None:
        return self.replay.send(model.StartRun(now=now))

    def claim(self, when: float, now: datetime, payload: tuple[str, int]) -> None:
        """A worker claims the dispatch, unless the task moved on (cancelled)."""
        node_id, attempt = payload
        replay, rng, clock = self.replay, self.rng, self.clock
        row = replay.rows[node_id]
        if row.state is not TaskState.PENDING or row.attempt != attempt:
            return
        node = replay.spec.nodes[node_id]
        if rng.random() < self.behaviour.crash_rate:
            # The owner shows in the error the lapsed lease leaves; survivors' leases vanish.
            ref = replay.claim(node_id, f"sim-w{rng.randint(1, 4)}:{rng.randint(1000, 60000)}")
            assert row.lease_expires_at is not None
            clock.at(row.lease_expires_at.timestamp() + rng.uniform(0.05, 0.6), "expire", ref)
            return
        ref = replay.claim(node_id, _SURVIVOR)
        draw = draw_attempt(rng, self.behaviour, node.task or node.id)
        ends = when + draw.duration_s
        beat = node.lease_s / 3
        for k in range(1, int(draw.duration_s / beat) + 1):
            clock.at(when + k * beat, "heartbeat", ref)
        clock.at(ends + REPORT_S, "report", (ref, draw))

    def heartbeat(self, when: float, now: datetime, ref: TaskRef) -> None:
        assert ref.lease_owner is not None
        self.replay.heartbeat(ref.node_id, ref.lease_owner)

    def report(self, when: float, now: datetime, payload: tuple[TaskRef, AttemptDraw]) -> Decision | None:
        ref, draw = payload
        replay = self.replay
        if draw.outcome == "ok":
            node = replay.spec.nodes[ref.node_id]
            output = task_output(node.task or node.id, replay.rows[ref.node_id].input, self.rng)
            return replay.send(model.TaskCompleted(ref=ref, output=output, now=now))
        assert draw.error_text is not None
        return replay.send(model.TaskFailed(ref=ref, error=draw.error_text, retryable=draw.outcome == "transient",
                                      now=now))

    def expire(self, when: float, now: datetime, ref: TaskRef) -> Decision | None:
        """The lease sweeper: a RUNNING attempt whose lease has lapsed."""
        row = self.replay.rows[ref.node_id]
        if row.state is not TaskState.RUNNING or row.attempt != ref.attempt:
            return None
        return self.replay.send(model.LeaseExpired(ref=ref, now=now))

    def timer(self, when: float, now: datetime, payload: tuple[str, str]) -> Decision | None:
        """The timer loop: a WAITING task whose ``wake_at`` has come."""
        node_id, task_id = payload
        row = self.replay.rows[node_id]
        if row.state is not TaskState.WAITING or row.task_id != task_id:
            return None
        return self.replay.send(model.TimerDue(task_id=task_id, node_id=node_id, now=now))

    def signal(self, when: float, now: datetime, payload: tuple[SignalPlan, bool]) -> Decision | None:
        signal, duplicate = payload
        decision = self.send(model.SignalReceived(name=signal.name, payload=signal.payload, now=now))
        if decision is not None and signal.duplicate_after_s is not None and not duplicate:
            self.clock.at(when + signal.duplicate_after_s, "signal", (signal, True))
        return decision

    def cancel(self, when: float, now: datetime, reason: str) -> Decision | None:
        return self.send(model.CancelRun(reason=reason, now=now))


def stop_stuck(replay: Replay, at: float, reason: str) -> None:
    """An operator cancels a run still active at ``at`` (epoch seconds)."""
    if replay.status is RunStatus.RUNNING:
        replay.now = utc(at)
        replay.send(model.CancelRun(reason=reason, now=replay.now))

