"""State machine scenarios, driven through ``machine_sim.Sim``: an in-memory stand-in
for the database shell that applies decisions with the repository's fences and checks
the engine's invariants on every action."""
from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from composer_ops.core import model
from composer_ops.core.machine import decide
from composer_ops.core.model import RunStatus, TaskState
from composer_ops.errors import Conflict

from .machine_sim import T0, Sim, kinds, task, wf
from .test_machine_signals import EVENTS
from .test_spec import EXAMPLE

# ---------------------------------------------------------------------------
# The SPEC 5 example, through both branches

#: charge completing decides the route SWITCH in the same call: these two actions
#: come first whatever the tier, then one action a branch
CHARGE_ROUTED = ["CompleteTask charge", "Create route COMPLETED"]


def test_example_gold_branch() -> None:
    sim = Sim(EXAMPLE, input={"amount": 12})
    start = sim.start()
    assert kinds(start) == ["Create charge PENDING"]
    create = start.actions[0]
    assert isinstance(create, model.CreateTask)
    assert create.input == {"amount": 12, "region": "eu"}
    assert create.queue == "payments"
    assert create.available_at == T0
    assert sim.loads == []

    done = sim.complete("charge", {"tier": "gold"})
    assert kinds(done) == [*CHARGE_ROUTED, "Create express PENDING", "Create standard SKIPPED"]
    route = done.actions[1]
    assert isinstance(route, model.CreateTask)
    assert route.branches == ("express",)
    assert route.output == {"value": "gold", "branches": ["express"]}
    assert sim.loads == [], "charge's output was decided in this call; nothing to load"

    sim.tick(3)
    joined = sim.complete("express", {"tracking": "X1"})
    assert kinds(joined) == ["CompleteTask express", "Create cool_off WAITING"]
    assert sim.rows["cool_off"].wake_at == sim.now + timedelta(seconds=5)

    sim.tick(5)
    woke = sim.fire("cool_off")
    assert kinds(woke) == ["ResolveWait cool_off COMPLETED", "Create delivered WAITING"]
    assert sim.rows["delivered"].wake_at == sim.now + timedelta(days=1)
    assert sim.nodes["delivered"].signal_name == "delivered"

    proof = {"signed_by": "ann"}
    got = sim.signal("delivered", proof)
    assert kinds(got) == ["ResolveWait delivered COMPLETED", "Create notify PENDING"]
    assert sim.rows["notify"].input == {"proof": proof}

    finished = sim.complete("notify", {"sent": True})
    assert kinds(finished) == ["CompleteTask notify", "FinishRun SUCCEEDED"]
    assert sim.status is RunStatus.SUCCEEDED
    assert sim.run_output == {"notify": {"sent": True}}
    assert sim.loads == []
    assert {n: s.state for n, s in sim.nodes.items()} == {
        "charge": TaskState.COMPLETED,
        "route": TaskState.COMPLETED,
        "express": TaskState.COMPLETED,
        "standard": TaskState.SKIPPED,
        "cool_off": TaskState.COMPLETED,
        "delivered": TaskState.COMPLETED,
        "notify": TaskState.COMPLETED,
    }


def test_example_default_branch() -> None:
    sim = Sim(EXAMPLE, input={"amount": 3})
    sim.start()
    sim.complete("charge", {"tier": "silver"})
    assert sim.state("standard") is TaskState.PENDING
    assert sim.state("express") is TaskState.SKIPPED
    assert sim.nodes["route"].branches == ("standard",)
    sim.complete("standard")
    sim.fire("cool_off")
    sim.signal("delivered", "ok")
    assert sim.rows["notify"].input == {"proof": "ok"}
    sim.complete("notify")
    assert sim.status is RunStatus.SUCCEEDED
    assert sim.run_output == {"notify": None}
    assert sim.loads == []


def test_switch_reads_an_earlier_output_through_the_store() -> None:
    spec = wf(
        task("a"),
        task("b"),
        {
            "id": "s",
            "type": "SWITCH",
            "depends_on": ["a", "b"],
            "expression": "$.nodes.a.output.k",
            "cases": {"x": ["c"]},
            "default": ["d"],
        },
        task("c", "s", input={"from_b": "$.nodes.b.output"}),
        task("d", "s"),
    )
    sim = Sim(spec)
    sim.start()
    sim.complete("a", {"k": "x"})
    assert sim.loads == []
    sim.complete("b", "B")
    assert sim.loads == [("a",)], "only the switch's referenced node is loaded"
    assert sim.state("c") is TaskState.PENDING and sim.state("d") is TaskState.SKIPPED
    assert sim.rows["c"].input == {"from_b": "B"}


def test_no_matching_case_and_no_default_skips_everything_downstream() -> None:
    doc = dict(EXAMPLE)
    doc["nodes"] = [dict(n) for n in EXAMPLE["nodes"]]
    # No default, the nodes it named moved to a case nothing matches: every case misses.
    switch = {k: v for k, v in doc["nodes"][1].items() if k != "default"}
    switch["cases"] = {**switch["cases"], "never": doc["nodes"][1]["default"]}
    doc["nodes"][1] = switch
    sim = Sim(doc, input={})
    sim.start()
    decision = sim.complete("charge", {"tier": "bronze"})
    downstream = ("express", "standard", "cool_off", "delivered", "notify")
    assert kinds(decision) == [*CHARGE_ROUTED, *(f"Create {n} SKIPPED" for n in downstream), "FinishRun SUCCEEDED"]
    assert sim.run_output == {"notify": None}


@pytest.mark.parametrize(
    ("value", "case"),
    [(1, "1"), (True, "true"), (None, "null"), ([1, 2], "[1, 2]"), ({"b": 1, "a": 2}, '{"a": 2, "b": 1}'), ("1", "1")],
)
def test_switch_matches_json_text_of_non_strings(value: Any, case: str) -> None:
    spec = wf(
        {"id": "s", "type": "SWITCH", "expression": "$.input.v", "cases": {case: ["hit"]}, "default": ["miss"]},
        task("hit", "s"),
        task("miss", "s"),
    )
    sim = Sim(spec, input={"v": value})
    sim.start()
    assert sim.state("hit") is TaskState.PENDING
    assert sim.state("miss") is TaskState.SKIPPED


def test_root_switch_finishes_in_one_decision() -> None:
    sim = Sim(wf({"id": "s", "type": "SWITCH", "expression": "$.config.mode"}, config={"mode": "x"}))
    decision = sim.start()
    assert kinds(decision) == ["Create s COMPLETED", "FinishRun SUCCEEDED"]
    assert sim.run_output == {"s": {"value": "x", "branches": []}}


def test_switch_with_several_branches_and_a_join() -> None:
    spec = wf(
        {"id": "s", "type": "SWITCH", "expression": "$.input.v", "cases": {"both": ["a", "b"]}, "default": ["c"]},
        task("a", "s"),
        task("b", "s"),
        task("c", "s"),
        task("join", "a", "b", "c"),
    )
    sim = Sim(spec, input={"v": "both"})
    sim.start()
    assert [sim.state(n) for n in "abc"] == [TaskState.PENDING, TaskState.PENDING, TaskState.SKIPPED]
    sim.complete("a")
    assert sim.state("join") is None, "a join waits for every dependency"
    sim.complete("b")
    assert sim.state("join") is TaskState.PENDING


def test_node_depending_on_switch_and_a_completed_task_runs_when_not_selected() -> None:
    spec = wf(
        task("t"),
        {"id": "s", "type": "SWITCH", "expression": "$.input.v", "cases": {"x": ["a"]}},
        task("a", "s"),
        task("b", "s", "t"),
    )
    sim = Sim(spec, input={"v": "x"})
    sim.start()
    assert sim.state("a") is TaskState.PENDING
    sim.complete("t")
    assert sim.state("b") is TaskState.PENDING, "t is a live dependency of b"


# ---------------------------------------------------------------------------
# WAIT


def test_wait_until_literal_and_reference() -> None:
    spec = wf(
        {"id": "lit", "type": "WAIT", "until": "2030-01-01T00:00:00+01:00"},
        {"id": "ref", "type": "WAIT", "until": "$.input.at"},
    )
    sim = Sim(spec, input={"at": "2031-02-03T04:05:06Z"})
    sim.start()
    assert sim.rows["lit"].wake_at == datetime(2029, 12, 31, 23, 0, tzinfo=UTC)
    assert sim.rows["ref"].wake_at == datetime(2031, 2, 3, 4, 5, 6, tzinfo=UTC)
    sim.fire("lit")
    decision = sim.fire("ref")
    assert kinds(decision) == ["ResolveWait ref COMPLETED", "FinishRun SUCCEEDED"]
    assert sim.run_output == {"lit": None, "ref": None}


@pytest.mark.parametrize("at", ["soon", 42, None, "2031-02-03T04:05:06"])
def test_wait_until_unusable_value_fails_the_node(at: Any) -> None:
    sim = Sim(wf(task("other"), {"id": "w", "type": "WAIT", "until": "$.input.at"}), input={"at": at})
    decision = sim.start()
    # "other" was created in the decision that failed the run: it is born CANCELLED,
    # so it is never dispatched (no PENDING row, no outbox row, no CancelTasks).
    assert kinds(decision) == ["Create other CANCELLED", "Create w FAILED", "FinishRun FAILED"]
    other = decision.actions[0]
    assert isinstance(other, model.CreateTask) and other.available_at is None
    assert other.error is not None and other.error.startswith('run failed: node "w" failed')
    error = sim.rows["w"].error
    assert error is not None and "not an ISO-8601 instant with a time zone" in error
    assert sim.run_reason is not None and sim.run_reason.startswith('node "w" failed: until $.input.at resolved to')
    assert sim.state("other") is TaskState.CANCELLED


def test_optional_wait_failure_lets_successors_run() -> None:
    sim = Sim(wf({"id": "w", "type": "WAIT", "until": "$.input.at", "optional": True}, task("next", "w")), input={})
    sim.start()
    assert sim.state("w") is TaskState.FAILED
    assert sim.state("next") is TaskState.PENDING


# ---------------------------------------------------------------------------
# Retries and failures

RETRYING = wf(
    task("a", retry={"max_attempts": 3, "initial_backoff_s": 2, "multiplier": 3, "max_backoff_s": 5}),
    task("b", "a"),
)


def test_retries_then_success() -> None:
    sim = Sim(RETRYING)
    sim.start()
    ref0 = sim.ref("a")
    first = sim.fail("a", "flaky")
    assert first.actions == (model.RequeueTask(ref=ref0, reason="flaky", available_at=T0 + timedelta(seconds=2)),)
    assert sim.nodes["a"].state is TaskState.PENDING and sim.nodes["a"].attempt == 1
    sim.tick(2)
    second = sim.fail("a", "flaky")
    assert isinstance(second.actions[0], model.RequeueTask)
    assert second.actions[0].available_at == sim.now + timedelta(seconds=5)
    sim.tick(5)
    assert kinds(sim.complete("a", "ok")) == ["CompleteTask a", "Create b PENDING"]
    assert sim.nodes["a"].attempt == 2


def test_retries_exhausted_fail_the_run() -> None:
    sim = Sim(RETRYING)
    sim.start()
    sim.fail("a")
    sim.tick(2)
    sim.fail("a")
    sim.tick(5)
    last = sim.fail("a", "still broken")
    assert kinds(last) == ["FailTask a", "FinishRun FAILED"]
    assert sim.run_reason == 'node "a" failed after 3 attempts: still broken'
    assert sim.state("b") is None


def test_non_retryable_error_skips_remaining_attempts() -> None:
    sim = Sim(RETRYING)
    sim.start()
    decision = sim.fail("a", "bad card", retryable=False)
    assert kinds(decision) == ["FailTask a", "FinishRun FAILED"]
    assert sim.run_reason == 'node "a" failed after 1 attempt: bad card'


def test_failure_cancels_the_other_active_tasks() -> None:
    spec = wf(task("a"), task("b"), {"id": "w", "type": "WAIT", "duration_s": 10}, task("c", "a"))
    sim = Sim(spec)
    sim.start()
    sim.claim("b")
    decision = sim.fail("a")
    cancel = decision.actions[1]
    assert isinstance(cancel, model.CancelTasks)
    assert cancel.task_ids == (sim.nodes["b"].task_id, sim.nodes["w"].task_id)
    assert 'node "a"' in cancel.reason
    assert [sim.state(n) for n in ("a", "b", "w", "c")] == [
        TaskState.FAILED,
        TaskState.CANCELLED,
        TaskState.CANCELLED,
        None,
    ]
    late = sim.send(model.TaskCompleted(ref=sim.ref("b"), output=1, now=sim.now))
    assert late.stale


def test_optional_failure_lets_successors_run() -> None:
    spec = wf(task("opt", optional=True), task("req"), task("join", "opt", "req"), task("only_opt", "opt"))
    sim = Sim(spec)
    sim.start()
    decision = sim.fail("opt", "meh")
    assert kinds(decision) == ["FailTask opt", "Create only_opt PENDING"]
    sim.complete("req")
    assert sim.state("join") is TaskState.PENDING
    sim.complete("join", 1)
    sim.complete("only_opt", 2)
    assert sim.status is RunStatus.SUCCEEDED
    assert sim.run_output == {"join": 1, "only_opt": 2}


def expire(sim: Sim, node_id: str, owner: str = "w1") -> model.Decision:
    """``owner`` claims the node's task and dies; the sweeper finds its lease lapsed."""
    ref = sim.claim(node_id, owner=owner)
    sim.tick(sim.spec.nodes[node_id].lease_s)
    return sim.send(model.LeaseExpired(ref=ref, now=sim.now))


def test_lease_expiry_requeues_at_once_without_consuming_the_retry_policy() -> None:
    sim = Sim(RETRYING)
    sim.start()
    ref = sim.claim("a", owner="dead-worker")
    early = sim.send(model.LeaseExpired(ref=ref, now=sim.now + timedelta(seconds=29)))
    assert early.stale and "has not expired" in str(early.actions[0])
    sim.tick(30)
    expired = sim.send(model.LeaseExpired(ref=ref, now=sim.now))
    assert kinds(expired) == ["RequeueTask a"]
    requeue = expired.actions[0]
    assert isinstance(requeue, model.RequeueTask) and requeue.lease_expired
    assert requeue.reason.startswith("lease of dead-worker expired at") and requeue.available_at == sim.now
    assert (sim.nodes["a"].attempt, sim.nodes["a"].lease_expiries) == (1, 1)
    # The dead worker comes back with its result: too late.
    assert sim.send(model.TaskCompleted(ref=ref, output=1, now=sim.now)).stale
    # Three handler failures are still allowed (max_attempts 3), on attempts 1, 2 and 3.
    assert kinds(sim.fail("a")) == ["RequeueTask a"]
    sim.tick(5)
    assert kinds(sim.fail("a")) == ["RequeueTask a"]
    sim.tick(5)
    assert kinds(sim.fail("a")) == ["FailTask a", "FinishRun FAILED"]
    assert sim.nodes["a"].attempt == 3
    assert sim.run_reason == 'node "a" failed after 3 attempts: boom'


def test_with_the_default_policy_a_crashed_workers_task_is_retried() -> None:
    """max_attempts 1 (no retry of handler failures): a lease expiry still re-queues."""
    sim = Sim(wf(task("a")))
    sim.start()
    assert kinds(expire(sim, "a")) == ["RequeueTask a"]
    assert kinds(sim.complete("a", "done")) == ["CompleteTask a", "FinishRun SUCCEEDED"]
    assert sim.run_output == {"a": "done"}


def test_a_handler_failure_after_an_expiry_is_its_first_attempt() -> None:
    sim = Sim(wf(task("a")))
    sim.start()
    expire(sim, "a")
    assert kinds(sim.fail("a")) == ["FailTask a", "FinishRun FAILED"]
    assert sim.run_reason == 'node "a" failed after 1 attempt: boom'


def test_lease_expiries_past_the_cap_fail_the_task_naming_them_and_the_last_owner() -> None:
    sim = Sim(wf(task("a", retry={"max_attempts": 5})))
    sim.start()
    for owner in ("w1", "w2", "w3"):                      # the default cap: 3 re-queues
        assert kinds(expire(sim, "a", owner)) == ["RequeueTask a"]
    assert kinds(sim.fail("a")) == ["RequeueTask a"]       # a handler failure in between changes nothing
    sim.tick(1)                                            # its backoff
    decision = expire(sim, "a", "w5")
    assert kinds(decision) == ["FailTask a", "FinishRun FAILED"]
    fail = decision.actions[0]
    assert isinstance(fail, model.FailTask)
    assert fail.reason.startswith("lease expired 4 times (max_lease_expiries is 3); last owner w5, "
                                  "whose lease expired at ")
    assert sim.run_reason == f'node "a" failed: {fail.reason}'


def test_max_lease_expiries_zero_fails_at_the_first_expiry() -> None:
    sim = Sim(wf(task("a", max_lease_expiries=0, retry={"max_attempts": 3})))
    sim.start()
    decision = expire(sim, "a", "gone")
    assert kinds(decision) == ["FailTask a", "FinishRun FAILED"]
    assert "lease expired once (max_lease_expiries is 0); last owner gone" in str(sim.run_reason)


# ---------------------------------------------------------------------------
# Stale reports


@pytest.fixture
def running() -> tuple[Sim, model.TaskRef]:
    sim = Sim(RETRYING)
    sim.start()
    return sim, sim.claim("a")


def test_result_from_a_previous_attempt_is_stale(running: tuple[Sim, model.TaskRef]) -> None:
    sim, ref = running
    sim.send(model.TaskFailed(ref=ref, error="x", retryable=True, now=sim.now))
    sim.tick(2)
    sim.claim("a")
    old = sim.send(model.TaskCompleted(ref=ref, output=1, now=sim.now))
    assert old.stale and "attempt 0" in str(old.actions[0])
    assert sim.state("a") is TaskState.RUNNING


def test_duplicate_result_is_stale(running: tuple[Sim, model.TaskRef]) -> None:
    sim, ref = running
    sim.send(model.TaskCompleted(ref=ref, output=1, now=sim.now))
    again = sim.send(model.TaskCompleted(ref=ref, output=2, now=sim.now))
    assert again.stale
    assert sim.rows["a"].output == 1
    assert sim.send(model.TaskFailed(ref=ref, error="x", retryable=False, now=sim.now)).stale


def test_result_after_the_lease_lapsed_is_stale(running: tuple[Sim, model.TaskRef]) -> None:
    sim, ref = running
    lapsed = sim.send(model.TaskCompleted(ref=ref, output=1, now=sim.now + timedelta(seconds=30)))
    assert lapsed.stale and "lapsed" in str(lapsed.actions[0])
    failed = sim.send(model.TaskFailed(ref=ref, error="x", retryable=True, now=sim.now + timedelta(seconds=31)))
    assert failed.stale
    assert sim.send(model.TaskCompleted(ref=ref, output=1, now=sim.now + timedelta(seconds=29))).finish is None
    assert sim.state("a") is TaskState.COMPLETED


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"lease_owner": "someone-else"}, "leased to w1"),
        ({"task_id": "t9999"}, "no task t9999"),
        ({"run_id": "other-run"}, "belongs to run other-run"),
        ({"node_id": "b"}, "no task"),
        ({"node_id": "ghost"}, 'has a task for node "ghost", which its definition'),
        ({"attempt": 1}, "attempt 1"),
    ],
)
def test_mismatched_refs_are_stale(running: tuple[Sim, model.TaskRef], change: dict[str, Any], fragment: str) -> None:
    sim, ref = running
    bad = dataclasses.replace(ref, **change)
    for event in (
        model.TaskCompleted(ref=bad, output=1, now=sim.now),
        model.TaskFailed(ref=bad, error="x", retryable=True, now=sim.now),
        model.LeaseExpired(ref=bad, now=sim.now + timedelta(hours=1)),
    ):
        decision = sim.send(event)
        assert decision.stale, event
        stale = decision.actions[0]
        assert isinstance(stale, model.Stale) and fragment in stale.reason
        # Only a node the definition lacks is odd data (logged as a warning, once):
        # the rest are late, repeated or misdirected reports.
        assert stale.odd is (bad.node_id == "ghost"), stale


def test_a_timer_for_a_node_not_in_the_definition_is_odd_data() -> None:
    sim = Sim(RETRYING)
    sim.start()
    decision = sim.send(model.TimerDue(task_id="t-ghost", node_id="ghost", now=sim.now))
    (stale,) = decision.actions
    assert isinstance(stale, model.Stale) and stale.odd and 'node "ghost", which its definition' in stale.reason


def test_owner_check_is_skipped_when_the_ref_has_none(running: tuple[Sim, model.TaskRef]) -> None:
    sim, ref = running
    decision = sim.send(model.TaskCompleted(ref=dataclasses.replace(ref, lease_owner=None), output=1, now=sim.now))
    assert not decision.stale


def test_result_for_a_task_not_yet_claimed_is_stale() -> None:
    sim = Sim(RETRYING)
    sim.start()
    decision = sim.send(model.TaskCompleted(ref=sim.ref("a"), output=1, now=sim.now))
    assert decision.stale and "PENDING, not RUNNING" in str(decision.actions[0])


def test_timer_for_a_task_node_or_wrong_task_is_stale() -> None:
    sim = Sim(wf(task("a"), {"id": "w", "type": "WAIT", "duration_s": 1}))
    sim.start()
    assert sim.fire("a").stale
    assert sim.send(model.TimerDue(task_id="t9999", node_id="w", now=sim.now)).stale
    assert sim.send(model.TimerDue(task_id="t9999", node_id="ghost", now=sim.now)).stale


def test_start_twice_is_stale() -> None:
    sim = Sim(RETRYING)
    sim.start()
    assert sim.start().stale


# ---------------------------------------------------------------------------
# Cancel and finished runs


def test_cancel_cancels_active_tasks_and_refuses_later_signals() -> None:
    sim = Sim(EVENTS)
    sim.start()
    ref = sim.claim("first")
    decision = sim.send(model.CancelRun(reason="operator said so", now=sim.now))
    assert decision.actions == (
        model.CancelTasks(task_ids=(ref.task_id,), reason="operator said so"),
        model.FinishRun(status=RunStatus.CANCELLED, output=None, reason="operator said so"),
    )
    assert sim.status is RunStatus.CANCELLED
    assert sim.send(model.TaskCompleted(ref=ref, output=1, now=sim.now)).stale
    with pytest.raises(Conflict, match="is CANCELLED; it accepts no signals"):
        sim.signal("go")
    with pytest.raises(Conflict, match="is CANCELLED; it cannot be cancelled"):
        sim.send(model.CancelRun(reason="again", now=sim.now))


def test_cancel_with_nothing_active_just_finishes() -> None:
    sim = Sim(RETRYING)
    decision = sim.send(model.CancelRun(reason="never mind", now=sim.now))
    assert kinds(decision) == ["FinishRun CANCELLED"]


def test_every_event_on_a_finished_run_is_stale() -> None:
    sim = Sim(wf({"id": "w", "type": "WAIT", "duration_s": 1}))
    sim.start()
    task_id = sim.nodes["w"].task_id
    sim.fire("w")
    assert sim.status is RunStatus.SUCCEEDED
    ref = model.TaskRef(task_id=task_id, run_id=sim.run_id, node_id="w", attempt=0)
    for event in (
        model.StartRun(now=sim.now),
        model.TaskCompleted(ref=ref, output=1, now=sim.now),
        model.TaskFailed(ref=ref, error="x", retryable=True, now=sim.now),
        model.LeaseExpired(ref=ref, now=sim.now),
        model.TimerDue(task_id=task_id, node_id="w", now=sim.now),
    ):
        decision = sim.send(event)
        assert decision.stale and "SUCCEEDED" in str(decision.actions[0])
    with pytest.raises(Conflict, match="SUCCEEDED; it accepts no signals"):
        decide(sim.snapshot(), model.SignalReceived(name="x", payload=None, now=sim.now), sim, sim.new_id)


# ---------------------------------------------------------------------------
# Outputs are loaded only when referenced


def test_outputs_loaded_only_for_referenced_nodes() -> None:
    spec = wf(
        task("a"),
        task("b"),
        task("c", "a", "b", input={"x": "$.nodes.a.output.v", "y": "$.input.y"}),
        task("d", "b"),
    )
    sim = Sim(spec, input={"y": 1})
    sim.start()
    sim.complete("a", {"v": "A"})
    sim.complete("b", {"v": "B"})
    assert sim.rows["c"].input == {"x": "A", "y": 1}
    assert sim.rows["d"].input == {}
    assert sim.loads == [("a",)]
    sim.complete("c", "C")
    sim.complete("d", "D")
    assert sim.loads == [("a",), ("c",)], "the run output loads the sink finished earlier"
    assert sim.run_output == {"c": "C", "d": "D"}


def test_skipped_referenced_node_resolves_to_none_without_a_load() -> None:
    spec = wf(
        {"id": "s", "type": "SWITCH", "expression": "$.input.v", "cases": {"x": ["a"]}, "default": ["b"]},
        task("a", "s"),
        task("b", "s"),
        task("c", "a", "b", input={"a": "$.nodes.a.output", "s": "$.nodes.s.output.value"}),
    )
    sim = Sim(spec, input={"v": "y"})
    sim.start()
    sim.complete("b")
    assert sim.rows["c"].input == {"a": None, "s": "y"}
    assert sim.loads == [("s",)]


# ---------------------------------------------------------------------------
# Odds and ends


def test_naive_now_is_refused() -> None:
    sim = Sim(RETRYING)
    with pytest.raises(ValueError, match="timezone-aware"):
        decide(sim.snapshot(), model.StartRun(now=datetime(2026, 1, 1)), sim, sim.new_id)


def test_decision_properties() -> None:
    assert model.Decision(actions=(model.Stale(reason="x"),)).stale
    done = model.FinishRun(status=RunStatus.SUCCEEDED, output={})
    assert model.Decision(actions=(model.BufferSignal(signal_id="s", name="n", payload=None), done)).finish == done
    assert not model.Decision(actions=()).stale
    assert model.Decision(actions=()).finish is None


def test_snapshot_is_not_mutated() -> None:
    sim = Sim(RETRYING)
    sim.start()
    sim.claim("a")
    snapshot = sim.snapshot()
    before = dict(snapshot.nodes)
    decide(snapshot, model.TaskCompleted(ref=sim.ref("a"), output=1, now=sim.now), sim, sim.new_id)
    assert dict(snapshot.nodes) == before
