"""State machine scenarios of signals and WAIT_FOR_SIGNAL timeouts, driven through
``machine_sim.Sim`` like the other scenarios in ``test_machine.py``."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from composer_ops.core.machine import decide
from composer_ops.core.model import (
    BufferSignal,
    ConsumeSignal,
    NodeState,
    ResolveWait,
    RunContext,
    RunSnapshot,
    RunStatus,
    Signal,
    SignalReceived,
    TaskState,
    TimerDue,
)
from composer_ops.core.spec import parse_spec
from composer_ops.errors import Conflict, Invalid

from .machine_sim import T0, Sim, kinds, task, wf

# ---------------------------------------------------------------------------
# Signals and timeouts

EVENTS = wf(
    task("first"),
    {"id": "w", "type": "WAIT_FOR_SIGNAL", "depends_on": ["first"], "signal": "go", "timeout_s": 60},
    task("after", "w", input={"got": "$.nodes.w.output"}),
)


def test_signal_before_wait_is_buffered_then_consumed() -> None:
    sim = Sim(EVENTS)
    sim.start()
    early = sim.signal("go", {"n": 1})
    [buffered] = early.actions
    assert isinstance(buffered, BufferSignal) and (buffered.name, buffered.payload) == ("go", {"n": 1})
    decision = sim.complete("first")
    assert kinds(decision) == ["CompleteTask first", "Create w COMPLETED", "ConsumeSignal", "Create after PENDING"]
    assert decision.actions[2] == ConsumeSignal(signal_id=buffered.signal_id)
    assert sim.rows["w"].output == {"n": 1}
    assert sim.rows["after"].input == {"got": {"n": 1}}
    assert sim.loads == []


def test_oldest_buffered_signal_is_consumed_first() -> None:
    sim = Sim(EVENTS)
    sim.start()
    sim.signal("go", "old")
    newer = sim.signal("go", "new").actions[0]
    assert isinstance(newer, BufferSignal)
    sim.complete("first")
    assert sim.rows["w"].output == "old"
    assert sim.pending_signals("go") == [Signal(id=newer.signal_id, name="go", payload="new")]


def test_signal_after_wait_resolves_it() -> None:
    sim = Sim(EVENTS)
    sim.start()
    sim.complete("first")
    assert sim.state("w") is TaskState.WAITING
    assert sim.rows["w"].wake_at == T0 + timedelta(seconds=60)
    decision = sim.signal("go", [1, 2])
    assert kinds(decision) == ["ResolveWait w COMPLETED", "Create after PENDING"]
    assert sim.rows["after"].input == {"got": [1, 2]}
    # The next signal has no waiter left: it is buffered, not lost.
    assert kinds(sim.signal("go", 3)) == ["BufferSignal"]


def test_one_buffered_signal_resolves_one_node_per_decision() -> None:
    spec = wf(
        task("first"),
        {"id": "w1", "type": "WAIT_FOR_SIGNAL", "depends_on": ["first"], "signal": "go"},
        {"id": "w2", "type": "WAIT_FOR_SIGNAL", "depends_on": ["first"], "signal": "go"},
    )
    sim = Sim(spec)
    sim.start()
    sim.signal("go", "only")
    decision = sim.complete("first")
    assert kinds(decision) == ["CompleteTask first", "Create w1 COMPLETED", "ConsumeSignal", "Create w2 WAITING"]
    assert sim.rows["w2"].wake_at is None
    sim.signal("go", "second")
    assert sim.rows["w2"].output == "second"
    assert sim.status is RunStatus.SUCCEEDED
    assert sim.run_output == {"w1": "only", "w2": "second"}


def test_earliest_waiter_gets_the_signal() -> None:
    spec = wf(
        {"id": "late", "type": "WAIT_FOR_SIGNAL", "depends_on": ["gate"], "signal": "go"},
        {"id": "early", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
        task("gate"),
    )
    sim = Sim(spec)
    sim.start()
    sim.complete("gate")
    assert sim.nodes["early"].task_id < sim.nodes["late"].task_id
    sim.signal("go", 1)
    assert sim.state("early") is TaskState.COMPLETED and sim.state("late") is TaskState.WAITING
    sim.signal("go", 2)
    assert (sim.rows["early"].output, sim.rows["late"].output) == (1, 2)
    assert sim.status is RunStatus.SUCCEEDED


class _NoReads:
    def load_outputs(self, node_ids: Any) -> dict[str, Any]:
        return {}

    def pending_signals(self, name: str) -> list[Signal]:
        return []

    def load_item(self, node_id: str, task_id: str) -> None:
        return None

    def item_outputs(self, node_id: str) -> list[Any]:
        return []


def test_the_earliest_waiter_by_database_time_wins_whatever_its_task_id() -> None:
    """Task ids are minted by whichever process made the decision, on its own clock; the
    database's created_at orders the waiters."""
    spec = parse_spec(wf({"id": "one", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
                         {"id": "two", "type": "WAIT_FOR_SIGNAL", "signal": "go"}))
    nodes = {
        # "two" was created a second after "one", by a process whose clock was behind:
        # its UUIDv7 task id sorts first.
        "one": NodeState(task_id="01900000-0000-7000-8000-00000000000b", state=TaskState.WAITING,
                         signal_name="go", created_at=T0),
        "two": NodeState(task_id="01900000-0000-7000-8000-00000000000a", state=TaskState.WAITING,
                         signal_name="go", created_at=T0 + timedelta(seconds=1)),
    }
    run = RunSnapshot(id="r", workflow_id="wf", workflow_version=1, status=RunStatus.RUNNING,
                      context=RunContext(input=None, config={}), spec=spec, nodes=nodes)
    decision = decide(run, SignalReceived(name="go", payload=1, now=T0 + timedelta(seconds=2)), _NoReads(),
                      lambda: "new")
    assert kinds(decision) == ["ResolveWait one COMPLETED"]


TIMED = wf(
    {"id": "w1", "type": "WAIT_FOR_SIGNAL", "signal": "go", "timeout_s": 10, "on_timeout": "continue"},
    {"id": "w2", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["gate"], "timeout_s": 60},
    task("gate"),
    task("after1", "w1", input={"got": "$.nodes.w1.output"}),
)


def test_a_signal_after_the_timeout_resolves_the_waiter_as_its_timer_would_then_goes_on() -> None:
    """By the clock the signal carries, w1 timed out (the timer loop has not run yet):
    w1 completes with null as on_timeout says, and the signal goes to w2."""
    sim = Sim(TIMED)
    sim.start()
    sim.tick(1)
    sim.complete("gate")                     # w2 waits from T0+1s, until T0+61s
    sim.tick(10)                             # T0+11s: w1 (until T0+10s) is overdue
    decision = sim.signal("go", "payload")
    assert kinds(decision) == ["ResolveWait w1 COMPLETED", "ResolveWait w2 COMPLETED", "Create after1 PENDING"]
    timeout, resolved = decision.actions[0], decision.actions[1]
    assert isinstance(timeout, ResolveWait) and timeout.timer and timeout.output is None
    assert isinstance(resolved, ResolveWait) and not resolved.timer and resolved.output == "payload"
    assert decision.refused is None
    assert sim.rows["after1"].input == {"got": None}


def test_a_signal_after_every_timeout_is_buffered_for_a_waiter_created_in_the_same_decision() -> None:
    spec = wf(
        {"id": "w1", "type": "WAIT_FOR_SIGNAL", "signal": "go", "timeout_s": 5, "on_timeout": "continue"},
        {"id": "w2", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["w1"]},
    )
    sim = Sim(spec)
    sim.start()
    sim.tick(6)
    decision = sim.signal("go", "late")
    assert kinds(decision) == ["ResolveWait w1 COMPLETED", "BufferSignal", "Create w2 COMPLETED",
                               "ConsumeSignal", "FinishRun SUCCEEDED"]
    buffered, consumed = decision.actions[1], decision.actions[3]
    assert isinstance(buffered, BufferSignal) and isinstance(consumed, ConsumeSignal)
    assert consumed.signal_id == buffered.signal_id
    assert sim.run_output == {"w2": "late"} and decision.refused is None


def test_a_signal_after_a_failing_timeout_is_refused_and_the_timeout_kept() -> None:
    sim = Sim(EVENTS)
    sim.start()
    sim.complete("first")
    sim.tick(61)
    decision = sim.signal("go", "too late")
    assert kinds(decision) == ["ResolveWait w FAILED", "FinishRun FAILED"]
    assert decision.refused is not None and "failed before the signal \"go\" arrived" in decision.refused
    assert sim.rows["w"].error == 'timed out waiting for signal "go" after 60s'
    assert sim.status is RunStatus.FAILED


def test_a_signal_after_a_timeout_that_finished_the_run_is_not_buffered() -> None:
    spec = wf({"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go", "timeout_s": 1, "on_timeout": "continue"})
    sim = Sim(spec)
    sim.start()
    sim.tick(2)
    decision = sim.signal("go", "x")
    assert kinds(decision) == ["ResolveWait w COMPLETED", "FinishRun SUCCEEDED"]
    assert decision.refused is not None and "SUCCEEDED before the signal" in decision.refused
    assert sim.signals == []


def test_a_signal_exactly_at_the_timeout_instant_is_too_late() -> None:
    """wake_at <= now is due, as for the timer loop's query."""
    sim = Sim(EVENTS)
    sim.start()
    sim.complete("first")
    sim.tick(60)
    assert sim.signal("go").refused is not None


def test_timeout_fails_the_node_and_the_run() -> None:
    sim = Sim(EVENTS)
    sim.start()
    sim.complete("first")
    sim.tick(60)
    decision = sim.fire("w")
    assert kinds(decision) == ["ResolveWait w FAILED", "FinishRun FAILED"]
    assert sim.rows["w"].error == 'timed out waiting for signal "go" after 60s'
    assert sim.run_reason == 'node "w" failed: timed out waiting for signal "go" after 60s'
    with pytest.raises(Conflict, match="run run-1 is FAILED; it accepts no signals"):
        sim.signal("go")


def test_timeout_continue_completes_with_null() -> None:
    doc = wf(
        task("first"),
        {
            "id": "w",
            "type": "WAIT_FOR_SIGNAL",
            "depends_on": ["first"],
            "signal": "go",
            "timeout_s": 1.5,
            "on_timeout": "continue",
        },
        task("after", "w", input={"got": "$.nodes.w.output"}),
    )
    sim = Sim(doc)
    sim.start()
    sim.complete("first")
    assert sim.rows["w"].wake_at == T0 + timedelta(seconds=1.5)
    decision = sim.fire("w")
    assert kinds(decision) == ["ResolveWait w COMPLETED", "Create after PENDING"]
    assert sim.rows["after"].input == {"got": None}


def test_timer_is_stale_once_the_signal_won() -> None:
    sim = Sim(EVENTS)
    sim.start()
    sim.complete("first")
    task_id = sim.nodes["w"].task_id
    sim.signal("go", "x")
    stale = sim.send(TimerDue(task_id=task_id, node_id="w", now=sim.now))
    assert stale.stale and "not WAITING" in str(stale.actions[0])


def test_signal_for_an_event_no_node_awaits_is_invalid() -> None:
    sim = Sim(EVENTS)
    sim.start()
    with pytest.raises(Invalid, match='no WAIT_FOR_SIGNAL node for signal "og"'):
        sim.signal("og")
