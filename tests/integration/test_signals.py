"""Signals on a real database: the waiter is the node created first by the database
clock; a timeout is judged by the database clock when the signal arrives; a task
cancelled in the decision that created it is never dispatched."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from composer_ops import Conflict, Engine
from composer_ops.engine import shell
from composer_ops.repo import definitions
from tests.integration.helpers import uuid7_at


def states(engine: Engine, run_id: str) -> dict[str, str]:
    return {t.node_id: t.state for t in engine.get_run(run_id).tasks}


def test_the_waiter_created_first_by_the_database_clock_gets_the_signal(engine: Engine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``late`` is created after ``early`` (a later transaction), by a process whose
    clock is years behind: its UUIDv7 task id sorts first. The signal still goes to
    ``early``."""
    engine.deploy({"id": "order", "nodes": [
        {"id": "early", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
        {"id": "gate", "type": "TASK", "task": "t"},
        {"id": "late", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["gate"]}]})
    run_id = engine.start("order")
    [claim] = engine.claim(["default"], "w", 1)
    monkeypatch.setattr(shell, "uuid7_text", lambda: uuid7_at(datetime(2001, 1, 1, tzinfo=UTC)))
    engine.complete(claim, None)
    monkeypatch.undo()
    tasks = {t.node_id: t for t in engine.get_run(run_id).tasks}
    assert tasks["late"].id < tasks["early"].id and tasks["late"].created_at > tasks["early"].created_at
    engine.signal(run_id, "go", "first")
    assert states(engine, run_id)["early"] == "COMPLETED" and states(engine, run_id)["late"] == "WAITING"


def test_a_signal_after_the_timeout_fails_the_node_as_the_timer_would(engine: Engine) -> None:
    """No coordinator runs: by the database clock the wait timed out before the signal
    came, so the node fails (on_timeout fail), the run fails, and the caller is told."""
    engine.deploy({"id": "deadline", "nodes": [
        {"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go", "timeout_s": 0.5}]})
    run_id = engine.start("deadline")
    time.sleep(0.8)
    with pytest.raises(Conflict, match='failed before the signal "go" arrived'):
        engine.signal(run_id, "go", "too late")
    run = engine.get_run(run_id)
    assert (run.status, run.tasks[0].state, run.tasks[0].output) == ("FAILED", "FAILED", None)
    assert run.error == {"error": 'node "w" failed: timed out waiting for signal "go" after 0.5s'}
    kinds = [(h.kind, h.node_id) for h in run.history]
    assert kinds == [("started", None), ("timer", "w"), ("signal", None)]
    assert "refused" in run.history[-1].detail
    assert engine.coordinator().run_once().timers_fired == 0     # nothing left for the timer loop


def test_a_signal_after_a_continue_timeout_goes_to_the_next_waiter(engine: Engine) -> None:
    engine.deploy({"id": "relay", "nodes": [
        {"id": "w1", "type": "WAIT_FOR_SIGNAL", "signal": "go", "timeout_s": 0.5, "on_timeout": "continue"},
        {"id": "w2", "type": "WAIT_FOR_SIGNAL", "signal": "go"}]})
    run_id = engine.start("relay")
    time.sleep(0.8)
    outcome = engine.signal(run_id, "go", "payload")
    assert outcome.finished == "SUCCEEDED"
    run = engine.get_run(run_id)
    assert {t.node_id: (t.state, t.output) for t in run.tasks} == {"w1": ("COMPLETED", None),
                                                                  "w2": ("COMPLETED", "payload")}


def test_a_signal_before_the_timeout_resolves_the_node(engine: Engine) -> None:
    engine.deploy({"id": "in_time", "nodes": [{"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go",
                                               "timeout_s": 60}]})
    run_id = engine.start("in_time")
    assert engine.signal(run_id, "go", 1).finished == "SUCCEEDED"


def test_a_task_cancelled_in_the_decision_that_created_it_is_never_dispatched(engine: Engine) -> None:
    """The start creates TASK ``work`` and then WAIT ``bad`` fails (its ``until`` is not
    an instant), failing the run in the same decision: ``work`` is born CANCELLED, and
    no outbox row (or NOTIFY) is written for it."""
    engine.deploy({"id": "doomed", "nodes": [
        {"id": "work", "type": "TASK", "task": "t"},
        {"id": "bad", "type": "WAIT", "until": "$.input.when"}]})
    run_id = engine.start("doomed", input={"when": "not a time"})
    run = engine.get_run(run_id)
    assert run.status == "FAILED"
    assert {t.node_id: t.state for t in run.tasks} == {"work": "CANCELLED", "bad": "FAILED"}
    assert all(t.finished_at is not None for t in run.tasks)
    with engine.pool.connection() as conn:
        row = conn.execute("SELECT count(*) FROM task_outbox WHERE run_id = %s", (run_id,)).fetchone()
    assert row == (0,)


def test_a_spec_in_the_old_spelling_deploys_runs_and_shows_the_new_one(engine: Engine) -> None:
    """WAIT_FOR_EVENT with "event" (the old spelling, SPEC's examples) is a WAIT_FOR_SIGNAL
    node: stored, waited on, resolved and shown under the new names."""
    old = {"id": "w", "type": "WAIT_FOR_EVENT", "event": "go"}   # the old spelling
    engine.deploy({"id": "old_spelling", "nodes": [old]})
    with engine.pool.connection() as conn:
        stored = definitions.get_deployed(conn, "old_spelling").spec_json["nodes"][0]
    assert (stored["type"], stored["signal"], "event" in stored) == ("WAIT_FOR_SIGNAL", "go", False)
    run_id = engine.start("old_spelling")
    [waiting] = engine.get_run(run_id).tasks
    assert (waiting.node_type, waiting.state, waiting.signal_name) == ("WAIT_FOR_SIGNAL", "WAITING", "go")
    assert engine.signal(run_id, "go", {"ok": 1}).finished is not None
    assert states(engine, run_id) == {"w": "COMPLETED"}
