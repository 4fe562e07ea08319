"""Retry (the RetryRun event): which nodes run again, what is kept, what is refused,
on every node type, through the invariant-checking in-memory shell."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_ops.core.model import CancelRun, ReopenRun, ResetTasks, RetryRun, RunStatus, TaskState
from composer_ops.errors import Conflict, Invalid
from tests.unit.machine_sim import Sim, kinds, task, wf

S = TaskState


def status(sim: Sim) -> RunStatus:
    """The run's status, read anew (so the type checker does not carry one over)."""
    return sim.status


def states(sim: Sim) -> dict[str, str]:
    return {n: str(s.state) for n, s in sim.nodes.items()}


def test_retry_from_the_failed_task_keeps_completed_upstream() -> None:
    sim = Sim(wf(task("a"), task("b", "a"), task("c", "b")))
    sim.start()
    sim.complete("a", {"x": 1})
    a_task = sim.nodes["a"].task_id
    sim.fail("b", "down", retryable=False)
    assert status(sim) is RunStatus.FAILED and states(sim) == {"a": "COMPLETED", "b": "FAILED"}
    decision = sim.retry()
    assert kinds(decision) == ["ResetTasks", "ReopenRun", "Create b PENDING"]
    assert status(sim) is RunStatus.RUNNING and sim.nodes["a"].task_id == a_task
    assert sim.nodes["b"].attempt == 0 and sim.rows["b"].error is None and sim.nodes["b"].task_id != a_task
    sim.complete("b")
    sim.complete("c", {"done": True})
    assert status(sim) is RunStatus.SUCCEEDED and sim.run_output == {"c": {"done": True}}
    assert sim.rows["a"].output == {"x": 1}


def test_retry_from_an_upstream_node_reruns_everything_downstream_of_it() -> None:
    sim = Sim(wf(task("a"), task("b", "a"), task("c", "b"), task("side")))
    sim.start()
    sim.complete("a")
    sim.complete("side", {"kept": True})
    sim.complete("b")
    sim.fail("c", retryable=False)
    side = sim.nodes["side"].task_id
    decision = sim.retry("a")
    reset = next(a for a in decision.actions if isinstance(a, ResetTasks))
    assert reset.node_ids == ("a", "b", "c")
    assert states(sim) == {"a": "PENDING", "side": "COMPLETED"} and sim.nodes["side"].task_id == side


def test_cancelled_siblings_run_again_and_the_join_runs_once() -> None:
    sim = Sim(wf(task("a"), task("b"), task("c", "a", "b")))
    sim.start()
    sim.fail("b", retryable=False)          # a is still pending: cancelled with the run
    assert states(sim) == {"a": "CANCELLED", "b": "FAILED"}
    assert kinds(sim.retry()) == ["ResetTasks", "ReopenRun", "Create a PENDING", "Create b PENDING"]
    sim.complete("a")
    sim.complete("b")
    assert kinds(sim.decisions[-1])[-1] == "Create c PENDING"
    sim.complete("c")
    assert status(sim) is RunStatus.SUCCEEDED


def test_a_join_after_a_completed_branch_waits_for_the_retried_one() -> None:
    sim = Sim(wf(task("a"), task("b"), task("c", "a", "b")))
    sim.start()
    sim.complete("a", 1)
    sim.fail("b", retryable=False)
    sim.retry()
    assert states(sim) == {"a": "COMPLETED", "b": "PENDING"}
    sim.complete("b", 2)
    sim.complete("c")
    assert status(sim) is RunStatus.SUCCEEDED


def test_retry_from_a_switch_decides_again_and_skips_cascade() -> None:
    spec = wf(task("charge"),
              {"id": "route", "type": "SWITCH", "depends_on": ["charge"], "expression": "$.nodes.charge.output.tier",
               "cases": {"gold": ["express"]}, "default": ["standard"]},
              task("express", "route"), task("standard", "route"), task("notify", "express", "standard"))
    sim = Sim(spec)
    sim.start()
    sim.complete("charge", {"tier": "gold"})
    sim.fail("express", retryable=False)
    assert states(sim)["standard"] == "SKIPPED"
    with pytest.raises(Invalid, match='node "express" failed the run'):
        sim.retry("notify")
    decision = sim.retry("route")
    assert kinds(decision) == ["ResetTasks", "ReopenRun", "Create route COMPLETED", "Create express PENDING",
                               "Create standard SKIPPED"]
    sim.complete("express")
    sim.complete("notify")
    assert status(sim) is RunStatus.SUCCEEDED


def test_retry_of_a_cancelled_wait_waits_again_from_now() -> None:
    sim = Sim(wf(task("a"), {"id": "pause", "type": "WAIT", "depends_on": ["a"], "duration_s": 60},
                 task("b", "pause")))
    sim.start()
    sim.complete("a")
    sim.send(CancelRun(reason="stop", now=sim.now))
    assert status(sim) is RunStatus.CANCELLED and states(sim)["pause"] == "CANCELLED"
    sim.tick(3600)
    sim.retry()
    assert states(sim)["pause"] == "WAITING" and sim.rows["pause"].wake_at == sim.now + timedelta(seconds=60)
    sim.tick(60)
    sim.fire("pause")
    sim.complete("b")
    assert status(sim) is RunStatus.SUCCEEDED


def test_retry_of_a_timed_out_wait_for_event_waits_for_a_new_signal() -> None:
    sim = Sim(wf({"id": "ok", "type": "WAIT_FOR_SIGNAL", "signal": "approved", "timeout_s": 10}, task("go", "ok")))
    sim.start()
    sim.tick(10)
    sim.fire("ok")
    assert status(sim) is RunStatus.FAILED and states(sim) == {"ok": "FAILED"}
    sim.retry()
    assert states(sim) == {"ok": "WAITING"}
    sim.signal("approved", {"by": "ops"})
    sim.complete("go")
    assert status(sim) is RunStatus.SUCCEEDED and sim.rows["ok"].output == {"by": "ops"}


def test_retry_takes_a_buffered_signal_for_the_node_that_waits_again() -> None:
    sim = Sim(wf(task("a"), {"id": "ok", "type": "WAIT_FOR_SIGNAL", "signal": "approved", "depends_on": ["a"]}))
    sim.start()
    sim.fail("a", retryable=False)
    sim.retry()
    sim.signal("approved", 1)           # buffered: "ok" does not wait yet
    sim.complete("a")
    assert states(sim)["ok"] == "COMPLETED" and status(sim) is RunStatus.SUCCEEDED


@pytest.mark.parametrize(("prepare", "message", "error"), [
    ("succeed", "SUCCEEDED: only a FAILED or CANCELLED run", Conflict),
    ("running", "is RUNNING: only a FAILED or CANCELLED run", Conflict),
    ("unknown", 'has no node "nope"', Invalid),
])
def test_retry_is_refused_with_a_clear_error(prepare: str, message: str, error: type[Exception]) -> None:
    sim = Sim(wf(task("a")))
    sim.start()
    if prepare == "succeed":
        sim.complete("a")
    elif prepare == "unknown":
        sim.fail("a", retryable=False)
    before = (sim.status, states(sim))
    with pytest.raises(error, match=message):
        sim.retry("nope") if prepare == "unknown" else sim.retry()
    assert (sim.status, states(sim)) == before


def test_the_decision_resets_then_reopens_then_creates() -> None:
    sim = Sim(wf(task("a"), task("b", "a")))
    sim.start()
    sim.fail("a", retryable=False)
    decision = sim.retry()
    assert isinstance(decision.actions[0], ResetTasks) and decision.actions[0].node_ids == ("a",)
    assert isinstance(decision.actions[1], ReopenRun) and decision.actions[1].status is RunStatus.FAILED


fan = st.integers(min_value=1, max_value=4)


@settings(max_examples=60, deadline=None)
@given(width=fan, fail_at=st.integers(min_value=0, max_value=3), from_root=st.booleans(),
       outcomes=st.lists(st.booleans(), min_size=8, max_size=8))
def test_retried_runs_always_finish_under_the_invariants(width: int, fail_at: int, from_root: bool,
                                                         outcomes: list[bool]) -> None:
    """root -> width parallel tasks -> join; one branch fails, the run is retried (from
    the root or from where it failed) until it succeeds; Sim checks every action."""
    branches = [f"b{i}" for i in range(width)]
    sim = Sim(wf(task("root"), *(task(b, "root") for b in branches), task("join", *branches)))
    sim.start()
    sim.complete("root")
    failing = branches[fail_at % width]
    for b in branches:
        if b == failing:
            sim.fail(b, retryable=False)
            break
        if outcomes[branches.index(b)]:
            sim.complete(b)
    assert status(sim) is RunStatus.FAILED
    sim.retry("root") if from_root else sim.retry()
    for _ in range(20):
        pending = [n for n, s in sim.nodes.items() if s.state is S.PENDING]
        if not pending:
            break
        for n in pending:
            sim.complete(n)
    assert status(sim) is RunStatus.SUCCEEDED
    assert set(sim.nodes) == {"root", "join", *branches}
    event: Any = RetryRun(now=sim.now)
    with pytest.raises(Conflict):
        sim.send(event)


@pytest.mark.parametrize(("status", "child", "refused"), [
    (None, None, None),                                   # the parent is gone: the child's retry is the only way
    ("SUCCEEDED", "c", None),                             # it went on without the child (an optional node)
    ("RUNNING", "c", "which went on without it and is RUNNING: retry this child once the parent has ended"),
    ("PENDING", "c", "which went on without it and is PENDING"),
    ("FAILED", "c", "which is FAILED: retry the parent from that node"),
    ("CANCELLED", "c", "which is CANCELLED: retry the parent"),
    ("RUNNING", "c2", "whose node stands for run c2 now"),   # the parent's retry started another child
    ("SUCCEEDED", "c2", "whose node stands for run c2 now"),
    ("RUNNING", None, "whose node stands for no child yet"),
    ("RUNNING", "c+waits", "whose node still waits for its finish"),     # on Citus, its finish on its way
])
def test_a_child_is_left_to_its_parent_where_the_parents_retry_runs_its_work(
        status: str | None, child: str | None, refused: str | None) -> None:
    from composer_ops.core.rerun import child_left_to_parent

    waits = child is not None and child.endswith("+waits")
    why = child_left_to_parent("c", "p", "refund", status, None if child is None else child.split("+")[0],
                               waits=waits)
    assert (why is None) == (refused is None) and (refused is None or refused in str(why)), why
