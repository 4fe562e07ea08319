"""SUB_WORKFLOW nodes in the state machine: the child started with a deterministic run
ID, its finish completing or failing the node, cancel and failure cascades, and the
deploy-time cycle check; driven through ``machine_sim.Sim``."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from composer_ops.core import model
from composer_ops.core.children import child_cycle, child_run_id
from composer_ops.core.model import RunStatus, TaskState
from composer_ops.core.runids import uuid7_timestamp, validate_run_id
from composer_ops.core.spec import WorkflowSpec, parse_spec
from composer_ops.errors import Invalid, NotFound

from .machine_sim import T0, Sim, kinds, task, wf


def sub(node_id: str = "child", *deps: str, **extra: Any) -> dict[str, Any]:
    return {"id": node_id, "type": "SUB_WORKFLOW", "workflow": "refund", "depends_on": list(deps),
            "input": {"amount": "$.input.amount"}, **extra}


def finished(sim: Sim, status: RunStatus, output: Any = None, error: str | None = None,
             node_id: str = "child") -> model.Decision:
    (start,) = [c for c in sim.children if c.node_id == node_id]
    return sim.send(model.ChildFinished(node_id=node_id, child_run_id=start.child_run_id, status=status,
                                        output=output, error=error, now=sim.now))


def test_the_child_starts_with_the_node_and_its_success_completes_the_node() -> None:
    sim = Sim(wf(sub(), task("after", "child", input={"refund": "$.nodes.child.output"})), input={"amount": 5})
    start = sim.start()
    assert kinds(start) == ["Create child WAITING", "StartChild"]
    (child,) = sim.children
    assert (child.workflow, child.version, child.input) == ("refund", None, {"amount": 5})
    assert child.child_run_id == child_run_id("run-1", "child", T0)
    done = finished(sim, RunStatus.SUCCEEDED, {"refunded": 5})
    assert kinds(done) == ["FinishChild", "Create after PENDING"]
    assert sim.rows["child"].output == {"refunded": 5}
    after = done.actions[-1]
    assert isinstance(after, model.CreateTask) and after.input == {"refund": {"refunded": 5}}


@pytest.mark.parametrize("status", [RunStatus.FAILED, RunStatus.CANCELLED])
def test_a_child_that_does_not_succeed_fails_the_node(status: RunStatus) -> None:
    sim = Sim(wf(sub()), input={"amount": 5})
    sim.start()
    child = sim.children[0].child_run_id
    finished(sim, status, error="card expired")
    assert sim.status is RunStatus.FAILED
    assert sim.run_reason == f'node "child" failed: child run {child} {status}: card expired'


def test_an_optional_child_failing_lets_the_run_go_on() -> None:
    sim = Sim(wf(sub(optional=True), task("after", "child")), input={"amount": 5})
    sim.start()
    finished(sim, RunStatus.FAILED)
    assert sim.nodes["after"].state is TaskState.PENDING


def test_a_finish_from_another_child_or_a_second_one_is_stale() -> None:
    sim = Sim(wf(sub()), input={"amount": 5})
    sim.start()
    other = child_run_id("run-1", "child", T0 + timedelta(seconds=1))
    assert sim.send(model.ChildFinished(node_id="child", child_run_id=other, status=RunStatus.SUCCEEDED,
                                        now=sim.now)).stale
    finished(sim, RunStatus.SUCCEEDED)
    assert finished(sim, RunStatus.FAILED).stale


def test_cancelling_the_parent_cancels_the_child() -> None:
    sim = Sim(wf(sub()), input={"amount": 5})
    sim.start()
    cancelled = sim.send(model.CancelRun(reason="stop", now=sim.now))
    assert kinds(cancelled) == ["CancelChild", "CancelTasks", "FinishRun CANCELLED"]
    assert sim.cancelled_children == [("child", sim.children[0].child_run_id)]


def test_a_failing_parent_cancels_its_children() -> None:
    sim = Sim(wf(sub(), task("other")), input={"amount": 5})
    sim.start()
    sim.fail("other", retryable=False)
    assert sim.status is RunStatus.FAILED
    assert sim.cancelled_children == [("child", sim.children[0].child_run_id)]


def test_a_child_the_failing_decision_would_start_is_never_started() -> None:
    bad_map = {"id": "m", "type": "MAP", "items": "$.input.amount", "task": "t", "depends_on": ["a"]}
    sim = Sim(wf(task("a"), sub("child", "a"), bad_map), input={"amount": 5})
    sim.start()
    done = sim.complete("a")          # creates "child", then "m" fails the run in the same decision
    assert "StartChild" not in kinds(done)
    assert sim.status is RunStatus.FAILED
    assert sim.children == [] and sim.cancelled_children == []
    assert sim.nodes["child"].state is TaskState.CANCELLED


@given(run=st.uuids(), node=st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
       ms=st.integers(1_700_000_000_000, 1_900_000_000_000))
def test_child_run_ids_are_valid_recent_uuid7_and_deterministic(run: Any, node: str, ms: int) -> None:
    at = datetime.fromtimestamp(ms / 1000, UTC)
    first = child_run_id(str(run), node, at)
    assert first == child_run_id(str(run), node, at)
    assert first != child_run_id(str(run), node + "x", at)
    validate_run_id(first, at)
    assert uuid7_timestamp(first) == at


CHILD = {"id": "refund", "nodes": [task("pay")]}


def _lookup(specs: dict[str, dict[str, Any]]) -> Any:
    def lookup(workflow: str, version: int | None) -> WorkflowSpec:
        if workflow not in specs:
            raise NotFound(f"workflow {workflow!r} does not exist")
        return parse_spec(specs[workflow])
    return lookup


def test_a_child_cycle_is_found_naming_the_node_and_the_chain() -> None:
    a = {"id": "a", "nodes": [{"id": "call_b", "type": "SUB_WORKFLOW", "workflow": "b"}]}
    b = {"id": "b", "nodes": [{"id": "call_c", "type": "SUB_WORKFLOW", "workflow": "c"}]}
    c = {"id": "c", "nodes": [{"id": "call_a", "type": "SUB_WORKFLOW", "workflow": "a"}]}
    found = child_cycle(parse_spec(a), _lookup({"b": b, "c": c}))
    assert found == 'node "call_b": SUB_WORKFLOW cycle "a" -> "b" -> "c" -> "a"'
    assert child_cycle(parse_spec(a), _lookup({"b": b, "c": {"id": "c", "nodes": [task("x")]}})) is None


@pytest.mark.parametrize(("node", "message"), [
    ({}, 'node "child": SUB_WORKFLOW node needs "workflow" (the child workflow\'s id)'),
    ({"workflow": "a b"}, 'node "child": workflow "a b" must match [A-Za-z0-9_.-]{1,128}'),
    ({"workflow": "refund", "version": 0}, 'node "child": version must be a positive integer, got 0'),
    ({"workflow": "refund", "input": {"x": "$.nodes.nope.output"}},
     'node "child": input.x references unknown node "nope"'),
    ({"workflow": "refund", "task": "t"}, 'node "child": unknown key "task" for a SUB_WORKFLOW node '
                                          '(it belongs to TASK / MAP nodes)'),
])
def test_bad_sub_workflow_specs_are_refused_naming_the_node(node: dict[str, Any], message: str) -> None:
    with pytest.raises(Invalid) as err:
        parse_spec(wf({"id": "child", "type": "SUB_WORKFLOW", **node}))
    assert str(err.value) == message


def test_sub_workflow_spec_round_trips() -> None:
    spec = parse_spec(wf(sub(version=3)))
    assert spec.to_json()["nodes"][0]["version"] == 3
    assert parse_spec(spec.to_json()) == spec
