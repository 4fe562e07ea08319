"""MAP nodes in the state machine: item counting, at most ``max_parallel`` in flight,
the failure policies, cancellation; scenarios and hypothesis properties, driven through
``machine_sim.Sim`` (which checks the engine's invariants on every action)."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from composer_ops.core import mapnode, model
from composer_ops.core.model import RunStatus, TaskState
from composer_ops.core.spec import parse_spec
from composer_ops.errors import Invalid

from .machine_sim import Sim, kinds, task, wf


def mapped(items: str = "$.input.ids", **extra: Any) -> dict[str, Any]:
    return {"id": "each", "type": "MAP", "items": items, "task": "do.each", "queue": "q", **extra}


def item_states(sim: Sim, node_id: str = "each") -> list[TaskState]:
    return [row.state for row in sim.items[node_id]]


def finish_item(sim: Sim, index: int, output: Any = None, *, error: str | None = None,
                retryable: bool = True, node_id: str = "each") -> model.Decision:
    ref = sim.claim(node_id, item=index)
    if error is None:
        return sim.send(model.TaskCompleted(ref=ref, output=output, now=sim.now))
    return sim.send(model.TaskFailed(ref=ref, error=error, retryable=retryable, now=sim.now))


def dispatched(sim: Sim, node_id: str = "each") -> list[int]:
    """The items waiting for a worker (an outbox row), by index."""
    return [row.index or 0 for row in sim.items[node_id]
            if row.state is TaskState.PENDING and row.available_at is not None]


def test_map_runs_every_item_and_outputs_them_in_item_order() -> None:
    sim = Sim(wf(mapped(max_parallel=2), task("after", "each", input={"all": "$.nodes.each.output"})),
              input={"ids": [10, 20, 30]})
    start = sim.start()
    assert kinds(start) == ["Create each WAITING", "CreateItems"]
    create = start.actions[1]
    assert isinstance(create, model.CreateItems)
    assert create.inputs == ({"item": 10, "index": 0}, {"item": 20, "index": 1}, {"item": 30, "index": 2})
    assert create.dispatch == 2
    assert dispatched(sim) == [0, 1]
    assert sim.nodes["each"].items == model.ItemCounts(total=3, started=2)

    # Items finish out of order; the output is still in item order.
    second = finish_item(sim, 1, "b")
    assert kinds(second) == ["CompleteTask each", "CountItems", "DispatchItems"]
    assert dispatched(sim) == [0, 2]
    finish_item(sim, 2, "c")
    assert sim.nodes["each"].items == model.ItemCounts(total=3, started=3, done=2)
    assert sim.nodes["each"].state is TaskState.WAITING
    last = finish_item(sim, 0, "a")
    assert kinds(last) == ["CompleteTask each", "CountItems", "FinishMap", "Create after PENDING"]
    assert sim.rows["each"].output == ["a", "b", "c"]
    after = last.actions[-1]
    assert isinstance(after, model.CreateTask)
    assert after.input == {"all": ["a", "b", "c"]}


def test_item_input_merges_the_node_input() -> None:
    sim = Sim(wf(mapped(input={"region": "$.config.region", "item": "shadowed"}), config={"region": "eu"}),
              input={"ids": ["x"]})
    start = sim.start()
    create = start.actions[1]
    assert isinstance(create, model.CreateItems)
    assert create.inputs == ({"region": "eu", "item": "x", "index": 0},)


def test_empty_items_complete_at_once_with_an_empty_list() -> None:
    sim = Sim(wf(mapped()), input={"ids": []})
    start = sim.start()
    assert kinds(start) == ["Create each COMPLETED", "FinishRun SUCCEEDED"]
    assert sim.run_output == {"each": []}


@pytest.mark.parametrize(("value", "kind"), [({"a": 1}, "an object"), ("abc", "a string"), (None, "null"),
                                             (3, "a number")])
def test_items_not_a_list_fail_the_run_clearly(value: Any, kind: str) -> None:
    sim = Sim(wf(mapped()), input={"ids": value})
    sim.start()
    assert sim.status is RunStatus.FAILED
    assert sim.rows["each"].error == f"items $.input.ids resolved to {kind}, not a list"
    assert sim.run_reason == f'node "each" failed: items $.input.ids resolved to {kind}, not a list'


def test_item_retries_then_fails_the_node_and_cancels_the_others() -> None:
    sim = Sim(wf(mapped(max_parallel=2, retry={"max_attempts": 2, "initial_backoff_s": 0})),
              input={"ids": [1, 2, 3]})
    sim.start()
    retried = finish_item(sim, 0, error="flaky")
    assert kinds(retried) == ["RequeueTask each"]
    assert sim.nodes["each"].items == model.ItemCounts(total=3, started=2)
    failed = finish_item(sim, 0, error="broken")
    assert kinds(failed) == ["FailTask each", "CountItems", "CancelItems", "FinishMap", "FinishRun FAILED"]
    assert item_states(sim) == [TaskState.FAILED, TaskState.CANCELLED, TaskState.CANCELLED]
    assert sim.status is RunStatus.FAILED
    assert sim.run_reason == 'node "each" failed: item 0 failed: after 2 attempts: broken'
    # The other item's late result is stale.
    late = model.TaskRef(task_id=sim.items["each"][1].task_id, run_id=sim.run_id, node_id="each", attempt=0)
    assert sim.send(model.TaskCompleted(ref=late, output=1, now=sim.now)).stale


def test_continue_policy_keeps_going_with_null_for_failed_items() -> None:
    sim = Sim(wf(mapped(max_parallel=1, on_item_failure="continue", retry={"max_attempts": 1})),
              input={"ids": [1, 2, 3]})
    sim.start()
    finish_item(sim, 0, "one")
    finish_item(sim, 1, error="bad", retryable=False)
    assert dispatched(sim) == [2]
    finish_item(sim, 2, "three")
    assert sim.status is RunStatus.SUCCEEDED
    assert sim.run_output == {"each": ["one", None, "three"]}
    assert sim.nodes["each"].items == model.ItemCounts(total=3, started=3, done=2, failed=1)


@pytest.mark.parametrize(("outputs", "fails"), [
    (["aaaa", "bbbb", "cccc"], False),          # ["aaaa","bbbb","cccc"]: 22 bytes, at the limit
    (["aaaa", "bbbb", "ccccc"], True),          # 23 bytes: one over
])
def test_assembled_output_over_the_limit_fails_the_node(monkeypatch: pytest.MonkeyPatch, outputs: list[str],
                                                        fails: bool) -> None:
    monkeypatch.setattr(mapnode, "MAX_BYTES", 22)
    sim = Sim(wf(mapped(max_parallel=3), task("after", "each", input={"all": "$.nodes.each.output"})),
              input={"ids": [1, 2, 3]})
    sim.start()
    for i, output in enumerate(outputs[:-1]):
        finish_item(sim, i, output)
    last = finish_item(sim, 2, outputs[-1])
    if not fails:
        assert kinds(last) == ["CompleteTask each", "CountItems", "FinishMap", "Create after PENDING"]
        assert sim.rows["each"].output == outputs
        return
    why = 'the assembled output of node "each" is 23 bytes of JSON; the limit is 22'
    assert kinds(last) == ["CompleteTask each", "CountItems", "FinishMap", "FinishRun FAILED"]
    finish = last.actions[2]
    assert isinstance(finish, model.FinishMap)
    assert (finish.state, finish.output, finish.reason) == (TaskState.FAILED, None, why)
    assert sim.nodes["each"].state is TaskState.FAILED
    assert item_states(sim) == [TaskState.COMPLETED] * 3
    assert sim.status is RunStatus.FAILED
    assert sim.run_reason == f'node "each" failed: {why}'


def test_an_optional_map_over_the_limit_fails_and_its_dependents_run_without_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapnode, "MAX_BYTES", 10)
    sim = Sim(wf(mapped(max_parallel=2, optional=True, on_item_failure="continue", retry={"max_attempts": 1}),
                 task("after", "each", input={"all": "$.nodes.each.output"})),
              input={"ids": [1, 2]})
    sim.start()
    finish_item(sim, 0, error="bad", retryable=False)
    last = finish_item(sim, 1, "0123456789")            # [null,"0123456789"]: 19 bytes
    assert kinds(last) == ["CompleteTask each", "CountItems", "FinishMap", "Create after PENDING"]
    after = last.actions[-1]
    assert isinstance(after, model.CreateTask) and after.input == {"all": None}
    assert sim.nodes["each"].state is TaskState.FAILED
    assert sim.status is RunStatus.RUNNING


def test_item_lease_expiry_requeues_the_item_only() -> None:
    sim = Sim(wf(mapped(max_parallel=1, lease_s=5, max_lease_expiries=1)), input={"ids": ["a", "b"]})
    sim.start()
    ref = sim.claim("each", item=0)
    sim.tick(6)
    expired = sim.send(model.LeaseExpired(ref=ref, now=sim.now))
    assert kinds(expired) == ["RequeueTask each"]
    assert sim.items["each"][0].lease_expiries == 1
    ref = sim.claim("each", item=0)
    sim.tick(6)
    failed = sim.send(model.LeaseExpired(ref=ref, now=sim.now))
    assert kinds(failed)[:4] == ["FailTask each", "CountItems", "CancelItems", "FinishMap"]
    assert sim.status is RunStatus.FAILED


def test_cancel_run_cancels_the_items() -> None:
    sim = Sim(wf(mapped(max_parallel=2)), input={"ids": [1, 2, 3]})
    sim.start()
    sim.claim("each", item=0)
    cancelled = sim.send(model.CancelRun(reason="stop", now=sim.now))
    assert kinds(cancelled) == ["CancelItems", "CancelTasks", "FinishRun CANCELLED"]
    assert item_states(sim) == [TaskState.CANCELLED] * 3


def test_map_created_in_the_decision_that_fails_the_run_creates_its_items_cancelled() -> None:
    sim = Sim(wf(task("a"), task("b"), {**mapped(), "depends_on": ["a"]}), input={"ids": [1, 2]})
    sim.start()
    sim.complete("a")
    assert sim.nodes["each"].state is TaskState.WAITING
    sim.fail("b", retryable=False)
    assert sim.status is RunStatus.FAILED
    assert item_states(sim) == [TaskState.CANCELLED] * 2


def test_retry_of_a_failed_map_runs_every_item_again() -> None:
    sim = Sim(wf(mapped(max_parallel=3, retry={"max_attempts": 1})), input={"ids": [1, 2]})
    sim.start()
    finish_item(sim, 0, "x")
    finish_item(sim, 1, error="no")
    assert sim.status is RunStatus.FAILED
    retried = sim.retry()
    assert kinds(retried) == ["ResetTasks", "ReopenRun", "Create each WAITING", "CreateItems"]
    assert item_states(sim) == [TaskState.PENDING] * 2
    finish_item(sim, 0, "x")
    finish_item(sim, 1, "y")
    assert sim.run_output == {"each": ["x", "y"]}


@pytest.mark.parametrize(("node", "message"), [
    ({"items": "$.input.ids"}, 'node "each": MAP node needs "task" (the handler name)'),
    ({"task": "t"}, 'node "each": MAP node needs "items" (a $. reference to a list)'),
    ({"task": "t", "items": [1, 2]}, 'node "each": items must be a $. reference to a list, got [1, 2]'),
    ({"task": "t", "items": "$.input.ids", "max_parallel": 0},
     'node "each": max_parallel must be an integer from 1 to 10000, got 0'),
    ({"task": "t", "items": "$.input.ids", "on_item_failure": "skip"},
     'node "each": on_item_failure must be "fail" or "continue", got "skip"'),
    ({"task": "t", "items": "$.nodes.later.output"},
     'node "each": items references unknown node "later"'),
    ({"task": "t", "items": "$.input.ids", "event": "e"},
     'node "each": unknown key "event" for a MAP node (it belongs to WAIT_FOR_SIGNAL nodes)'),
])
def test_bad_map_specs_are_refused_naming_the_node(node: dict[str, Any], message: str) -> None:
    with pytest.raises(Invalid) as err:
        parse_spec(wf({"id": "each", "type": "MAP", **node}))
    assert str(err.value) == message


def test_map_spec_round_trips_with_its_defaults() -> None:
    spec = parse_spec(wf(mapped()))
    doc = spec.to_json()["nodes"][0]
    assert (doc["max_parallel"], doc["on_item_failure"], doc["items"]) == (10, "fail", "$.input.ids")
    assert parse_spec(spec.to_json()) == spec


# ---------------------------------------------------------------------------
# Properties

#: What a worker does next to one item: complete it, fail it (retryably or not), or
#: let its lease lapse.
MOVES = st.sampled_from(("complete", "fail", "fatal", "lapse"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(total=st.integers(0, 12), max_parallel=st.integers(1, 4), policy=st.sampled_from(("fail", "continue")),
       attempts=st.integers(1, 2), moves=st.lists(st.tuples(st.integers(0, 11), MOVES), max_size=60))
def test_map_counts_items_and_bounds_the_items_in_flight(total: int, max_parallel: int, policy: str,
                                                          attempts: int, moves: list[tuple[int, str]]) -> None:
    sim = Sim(wf(mapped(max_parallel=max_parallel, on_item_failure=policy, lease_s=5, max_lease_expiries=0,
                        retry={"max_attempts": attempts, "initial_backoff_s": 0})),
              input={"ids": list(range(total))})
    sim.start()
    if total == 0:
        assert sim.status is RunStatus.SUCCEEDED
        return
    outcomes: dict[int, str] = {}

    def step(pick: int, move: str) -> None:
        ready = dispatched(sim)
        if sim.status is not RunStatus.RUNNING or not ready:
            return
        index = ready[pick % len(ready)]
        ref = sim.claim("each", item=index)
        if move == "complete":
            sim.send(model.TaskCompleted(ref=ref, output=index * 10, now=sim.now))
        elif move == "lapse":
            sim.tick(6)
            sim.send(model.LeaseExpired(ref=ref, now=sim.now))
        else:
            sim.send(model.TaskFailed(ref=ref, error="x", retryable=move == "fail", now=sim.now))
        outcomes[index] = move
        check()

    def check() -> None:
        rows = sim.items["each"]
        counts = sim.nodes["each"].items
        assert counts is not None
        started = [r.index for r in rows if r.state is not TaskState.PENDING or r.available_at is not None]
        assert started == list(range(len(started))), "items are dispatched in item order"
        if sim.status is RunStatus.RUNNING:
            in_flight = [r for r in rows if r.state in (TaskState.PENDING, TaskState.RUNNING)
                         and (r.state is TaskState.RUNNING or r.available_at is not None)]
            assert len(in_flight) <= max_parallel
            assert counts.started == len(started)
            assert counts.done == sum(r.state is TaskState.COMPLETED for r in rows)
            assert counts.failed == sum(r.state is TaskState.FAILED for r in rows)
            assert counts.in_flight == len(in_flight)
            assert len(in_flight) == min(max_parallel, total - counts.finished)

    check()
    for pick, move in moves:
        step(pick, move)
    while sim.status is RunStatus.RUNNING:       # drain: every item completes
        step(0, "complete")
    rows = sim.items["each"]
    failed = [r.index for r in rows if r.state is TaskState.FAILED]
    if policy == "fail" and failed:
        assert sim.status is RunStatus.FAILED and len(failed) == 1
        assert all(r.state in model.TERMINAL_TASK_STATES for r in rows)
        assert sim.run_reason is not None and f"item {failed[0]} failed" in sim.run_reason
    else:
        assert sim.status is RunStatus.SUCCEEDED
        assert sim.run_output == {"each": [None if i in failed else i * 10 for i in range(total)]}
