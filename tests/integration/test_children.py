"""SUB_WORKFLOW nodes end to end on a real server: the child started in the parent's
decision, its finish reaching the parent, cancel cascades, deploy-time refusals
(core/children.py, engine/starts.py and the shell's child actions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.core.children import child_run_id
from composer_ops.errors import Conflict, Invalid
from composer_ops.repo.rows import Claim
from composer_ops.testing.processes import wait_for
from examples.fanout_worker import make_worker

REFUND = {"id": "refund", "nodes": [
    {"id": "pay_back", "type": "TASK", "task": "refund.pay", "queue": "kids", "input": {"amount": "$.input.amount"}}]}


def parent_spec(**extra: Any) -> dict[str, Any]:
    return {"id": "order", "nodes": [
        {"id": "refund", "type": "SUB_WORKFLOW", "workflow": "refund", "input": {"amount": "$.input.amount"},
         **extra},
        {"id": "after", "type": "TASK", "task": "order.after", "queue": "kids", "depends_on": ["refund"],
         "input": {"refund": "$.nodes.refund.output"}}]}


def claim(engine: Engine) -> list[Claim]:
    return engine.claim(["kids"], "w1", 10)


def test_the_child_runs_and_its_output_completes_the_parents_node(engine: Engine, db_url: str) -> None:
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    run = engine.get_run(parent)
    (node,) = [t for t in run.tasks if t.node_id == "refund"]
    assert node.state == "WAITING"
    (child,) = run.children
    assert child.id == child_run_id(parent, "refund", node.created_at)
    assert (child.node_id, child.workflow_id, child.status) == ("refund", "refund", "RUNNING")
    kid = engine.get_run(child.id)
    assert (kid.parent_run_id, kid.parent_node_id, kid.input) == (parent, "refund", {"amount": 7})
    (task,) = claim(engine)
    assert (task.run_id, task.input) == (child.id, {"amount": 7})
    engine.complete(task, {"refunded": 7})
    assert engine.get_run(child.id).status == "SUCCEEDED"
    (after,) = claim(engine)
    assert (after.run_id, after.input) == (parent, {"refund": {"pay_back": {"refunded": 7}}})
    engine.complete(after, "done")
    run = engine.get_run(parent)
    assert run.status == "SUCCEEDED"
    assert [h.kind for h in run.history if h.kind.startswith("child")] == ["child_started", "child_finished"]


def test_a_failed_child_fails_the_parent(engine: Engine) -> None:
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    (task,) = claim(engine)
    engine.fail(task, "bank says no", retryable=False)
    run = engine.get_run(parent)
    assert run.status == "FAILED"
    assert run.error == {"error": f'node "refund" failed: child run {task.run_id} FAILED: node "pay_back" failed '
                                  'after 1 attempt: bank says no'}


def test_a_failing_child_writes_its_finish_and_the_cancels_it_caused(engine: Engine) -> None:
    """A child's failure fails its parent and cancels the parent's task still running: the
    parent's history has the child's finish and then the cancel (the first version wrote
    the cancel instead of the finish)."""
    engine.deploy(REFUND)
    engine.deploy({"id": "order", "nodes": [
        {"id": "refund", "type": "SUB_WORKFLOW", "workflow": "refund", "input": {"amount": "$.input.amount"}},
        {"id": "side", "type": "TASK", "task": "order.side", "queue": "kids"}]})
    parent = engine.start("order", input={"amount": 7})
    claimed = {c.node_id: c for c in claim(engine)}
    assert set(claimed) == {"pay_back", "side"}
    engine.fail(claimed["pay_back"], "bank says no", retryable=False)
    run = engine.get_run(parent)
    assert run.status == "FAILED"
    kinds = [(h.kind, (h.detail or {}).get("finished"), (h.detail or {}).get("nodes")) for h in run.history]
    assert kinds[-2:] == [("child_finished", "FAILED", None), ("cancelled", None, ["side"])], kinds


def test_a_run_whose_definition_is_missing_is_cancelled_with_its_child_and_items(engine: Engine,
                                                                                  db_url: str) -> None:
    """Odd data: the run's definition version is gone. Its cancel is decided on a stand-in
    made from its rows: the SUB_WORKFLOW node's child (found by its derived ID) and the
    MAP node's items are cancelled with it; any other event is refused."""
    from composer_ops.errors import BrokenRun

    engine.deploy(REFUND)
    engine.deploy({"id": "order", "nodes": [
        {"id": "refund", "type": "SUB_WORKFLOW", "workflow": "refund", "input": {"amount": "$.input.amount"}},
        {"id": "each", "type": "MAP", "task": "order.each", "queue": "kids", "items": "$.input.xs"}]})
    parent = engine.start("order", input={"amount": 7, "xs": [1, 2, 3]})
    (child,) = engine.get_run(parent).children
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE workflow_runs SET workflow_version = 99 WHERE id = %s", (parent,))
    with pytest.raises(BrokenRun, match="no event but a cancel can be decided on it"):
        engine.signal(parent, "go")
    engine.cancel(parent, reason="odd data")
    with psycopg.connect(db_url) as conn:
        states = conn.execute("SELECT state, count(*) FROM task_instances WHERE run_id = %s GROUP BY 1",
                              (parent,)).fetchall()
        status = conn.execute("SELECT status FROM workflow_runs WHERE id = %s", (parent,)).fetchone()
    assert status == ("CANCELLED",) and states == [("CANCELLED", 5)], states    # 2 nodes and 3 items
    assert engine.get_run(child.id).status == "CANCELLED"


def test_a_failed_child_is_retried_through_its_parent_only(engine: Engine, db_url: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A child run retried on its own would finish unseen by its parent, and the
    parent's retry would then run the child's work a second time: refused, naming the
    parent's retry, which starts a new child."""
    from composer_ops.cli import main

    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    (task,) = claim(engine)
    engine.fail(task, "bank says no", retryable=False)
    child = task.run_id
    with pytest.raises(Conflict, match=f"run {child} is the child of run {parent} .node \"refund\"., which is FAILED"):
        engine.retry(child)
    assert main(["runs", "retry", child, "--yes", "--database-url", db_url]) == 1
    err = capsys.readouterr().err
    assert f"composer-ops runs retry {parent} --from refund" in err and err.count("\n") == 1, err
    assert (engine.get_run(child).status, engine.get_run(parent).status) == ("FAILED", "FAILED")
    engine.retry(parent, "refund")
    (again,) = claim(engine)
    assert again.run_id != child
    engine.complete(again, {"refunded": 7})
    (after,) = claim(engine)
    engine.complete(after, "done")
    assert engine.get_run(parent).status == "SUCCEEDED" and engine.get_run(child).status == "FAILED"


def test_a_bulk_retry_leaves_children_to_their_parents_and_does_not_count_them(
        engine: Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A bulk retry selects the failed children with their parents. Each child is left to
    its parent's retry, with why, and not counted against --limit: the selection goes on
    to the next parent. The first version retried a child once its parent's retry,
    earlier in the same command, had made the parent RUNNING: the work twice."""
    from composer_ops.cli import main

    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    pairs = []
    for amount in (1, 2):
        parent = engine.start("order", input={"amount": amount})
        (task,) = claim(engine)
        engine.fail(task, "bank says no", retryable=False)
        pairs.append((parent, task.run_id))
    (p1, c1), (p2, c2) = pairs
    assert max(p1, c1) < min(p2, c2)     # the first page of two holds a child (a child's ID shares its parent's ms)
    args = ["runs", "retry", "--since", "1h", "--limit", "2", "--json", "--database-url", db_url]
    assert main(args) == 0
    dry = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in dry["retried"]] == [p1, p2] and dry["refused"] == []
    left = [c1] + ([c2] if c2 < p2 else [])          # the selection stops at the limit
    assert [r["run_id"] for r in dry["left_to_parent"]] == left, dry
    assert "which is FAILED: retry the parent from that node" in dry["left_to_parent"][0]["why"]
    assert {engine.get_run(r).status for r in (p1, c1, p2, c2)} == {"FAILED"}     # a dry run
    assert main(args[:-3] + ["--yes", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert f"left child run {c1} to its parent: run {c1} is the child of run {p1}" in out
    assert out.rstrip().endswith(f"retried 2 run(s), 0 refused, {len(left)} child run(s) left to their parent"), out
    assert [engine.get_run(r).status for r in (p1, c1, p2, c2)] == ["RUNNING", "FAILED", "RUNNING", "FAILED"]
    children = {t.run_id for t in claim(engine)}
    assert len(children) == 2 and not children & {c1, c2}     # the parents' new children, the old ones not run


def test_a_child_its_parents_retry_replaced_is_not_retried(engine: Engine) -> None:
    """Once the parent's retry started a new child for the node, the old child's work is
    in hand: its own retry would run it twice, while the parent runs and after."""

    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    (task,) = claim(engine)
    engine.fail(task, "bank says no", retryable=False)
    old = task.run_id
    engine.retry(parent, "refund")
    (again,) = claim(engine)
    with pytest.raises(Conflict, match=f"run {old} is the child of run {parent} .node \"refund\"., which is RUNNING "
                                       f"and whose node stands for run {again.run_id} now"):
        engine.retry(old)
    engine.complete(again, {"refunded": 7})
    (after,) = claim(engine)
    engine.complete(after, "done")
    assert engine.get_run(parent).status == "SUCCEEDED"
    with pytest.raises(Conflict, match="which is SUCCEEDED and whose node stands for run"):
        engine.retry(old)
    assert engine.get_run(old).status == "FAILED"


def test_a_failed_child_of_an_optional_node_is_retried_on_its_own(engine: Engine) -> None:
    """Its parent went on (the node is optional) and cannot be retried: the child's own
    retry is the way to run its work again, and its finish reaches the parent as stale."""
    engine.deploy(REFUND)
    engine.deploy(parent_spec(optional=True))
    parent = engine.start("order", input={"amount": 7})
    (task,) = claim(engine)
    engine.fail(task, "bank says no", retryable=False)
    (after,) = claim(engine)
    engine.complete(after, "done")
    assert engine.get_run(parent).status == "SUCCEEDED"
    engine.retry(task.run_id)
    (again,) = claim(engine)
    assert again.run_id == task.run_id
    engine.complete(again, {"refunded": 7})
    assert engine.get_run(task.run_id).status == "SUCCEEDED" and engine.get_run(parent).status == "SUCCEEDED"


def test_a_failed_child_of_an_optional_node_waits_for_its_running_parent_to_end(engine: Engine) -> None:
    """While the parent that went on without it runs, the child is not retried: cancelling
    or failing the parent would not reach it (only the children its active nodes stand
    for are cancelled) and the parent's retry from the node would start a second child.
    Once the parent has ended SUCCEEDED, the child's retry runs its work again."""
    engine.deploy(REFUND)
    engine.deploy(parent_spec(optional=True))
    parent = engine.start("order", input={"amount": 7})
    (task,) = claim(engine)
    engine.fail(task, "bank says no", retryable=False)
    assert engine.get_run(parent).status == "RUNNING"           # it went on: its next node is queued
    with pytest.raises(Conflict, match="which went on without it and is RUNNING"):
        engine.retry(task.run_id)
    assert engine.get_run(task.run_id).status == "FAILED"
    engine.cancel(parent, reason="done with it")
    assert engine.get_run(task.run_id).status == "FAILED"       # nothing of the child is running
    assert claim(engine) == []


def test_cancelling_the_parent_cancels_the_child_and_its_tasks(engine: Engine, db_url: str) -> None:
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    (task,) = claim(engine)
    engine.cancel(parent, reason="customer changed their mind")
    kid = engine.get_run(task.run_id)
    assert kid.status == "CANCELLED"
    assert [t.state for t in kid.tasks] == ["CANCELLED"]
    assert engine.complete(task, "late").stale is not None
    assert engine.get_run(parent).status == "CANCELLED"


def test_a_child_that_finishes_at_its_start_completes_the_node_in_the_same_transaction(engine: Engine) -> None:
    engine.deploy({"id": "instant", "nodes": [
        {"id": "none", "type": "MAP", "items": "$.input.ids", "task": "x"}]})
    engine.deploy({"id": "outer", "nodes": [
        {"id": "call", "type": "SUB_WORKFLOW", "workflow": "instant", "input": {"ids": []}}]})
    parent = engine.start("outer")
    run = engine.get_run(parent)
    assert run.status == "SUCCEEDED"
    assert run.output == {"call": {"none": []}}


def test_a_child_whose_workflow_was_disabled_fails_the_node(engine: Engine) -> None:
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    engine.set_enabled("refund", False)
    parent = engine.start("order", input={"amount": 7})
    run = engine.get_run(parent)
    assert run.status == "FAILED"
    assert run.error["error"] == ('node "refund" failed: its child did not start: workflow \'refund\' is '
                                  "disabled; it accepts no new runs"), run.error     # no run named: none exists


@pytest.mark.parametrize(("specs", "message"), [
    ([parent_spec()], 'node "refund": unknown child workflow: workflow \'refund\' does not exist (deploy it first)'),
    ([REFUND, parent_spec(version=9)],
     'node "refund": unknown child workflow: workflow definition refund v9 does not exist'),
    ([{"id": "order", "nodes": [{"id": "me", "type": "SUB_WORKFLOW", "workflow": "order"}]}],
     'node "me": SUB_WORKFLOW cycle "order" -> "order"'),
    ([{"id": "a", "nodes": [{"id": "x", "type": "TASK", "task": "t"}]},
      {"id": "b", "nodes": [{"id": "call_a", "type": "SUB_WORKFLOW", "workflow": "a"}]},
      {"id": "a", "nodes": [{"id": "call_b", "type": "SUB_WORKFLOW", "workflow": "b"}]}],
     'node "call_b": SUB_WORKFLOW cycle "a" -> "b" -> "a"'),
])
def test_deploy_refuses_unknown_children_and_cycles(engine: Engine, db_url: str, specs: list[dict[str, Any]],
                                                   message: str) -> None:
    *fine, refused = specs
    for spec in fine:
        engine.deploy(spec)
    with pytest.raises(Invalid) as err:
        engine.deploy(refused)
    assert str(err.value) == message
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT count(*) FROM workflow_definitions WHERE id = %s", (refused["id"],)).fetchone()
    assert row == (sum(s["id"] == refused["id"] for s in fine),)     # nothing stored


def test_runs_show_links_parent_and_child_both_ways(engine: Engine, db_url: str) -> None:
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    (child,) = engine.get_run(parent).children

    def show(run_id: str, *extra: str) -> str:
        env = {**os.environ, "COMPOSER_DATABASE_URL": db_url}
        return subprocess.run([sys.executable, "-m", "composer_ops", "runs", "show", run_id, *extra],
                              env=env, capture_output=True, text=True, check=True, timeout=60).stdout

    assert f"child: run {child.id} of refund (node refund)  RUNNING" in show(parent)
    assert f"parent: run {parent} (node refund)" in show(child.id)
    shown = json.loads(show(parent, "--json"))
    assert shown["children"] == [{"id": child.id, "node_id": "refund", "workflow_id": "refund", "status": "RUNNING"}]
    assert json.loads(show(child.id, "--json"))["parent_run_id"] == parent


def test_the_examples_run_to_completion(engine: Engine) -> None:
    """examples/charge_all.json (MAP) and examples/returns.json calling examples/refund.json
    (SUB_WORKFLOW), served by examples/fanout_worker.py."""
    root = Path(__file__).resolve().parents[2] / "examples"
    for name in ("charge_all", "refund", "returns"):
        engine.deploy(json.loads((root / f"{name}.json").read_text()))
    charged = engine.start("charge-all", input={"day": "2026-12-01"})
    returned = engine.start("returns", input={"order": "o-1"})
    worker = make_worker(engine)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: all(engine.get_run(r).status != "RUNNING" for r in (charged, returned)),
                 timeout=120, what="both example runs")
    finally:
        worker.stop()
        thread.join(60)
    assert engine.get_run(charged).output == {"summary": {"charged": sum(10 + i for i in range(20)), "failed": 0}}
    assert engine.get_run(returned).output == {"notify": {"notified": True,
                                                          "proof": {"pay_back": {"order": "o-1", "refunded": 25}}}}


def test_the_demo_runs_finish_and_leave_one_map_in_flight(db_url: str) -> None:
    from examples import fanout_demo

    runs = fanout_demo.run(db_url)
    with Engine.connect(db_url) as engine:
        status = {label: engine.get_run(r).status for label, r in runs.items()}
        bad = engine.get_run(runs["charge-all (a bad invoice)"])
    assert status == {"charge-all": "SUCCEEDED", "charge-all (a bad invoice)": "SUCCEEDED", "returns 1": "SUCCEEDED",
                      "returns 2": "SUCCEEDED", "charge-all (in flight)": "RUNNING"}
    assert bad.output == {"summary": {"charged": sum(10 + i for i in range(20)) - 13, "failed": 1}}
