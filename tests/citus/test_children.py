"""SUB_WORKFLOW nodes on Citus: the tests of a single server
(tests/integration/test_children.py), then the row path only Citus takes
(engine/childrows.py): a child's start, cancel and finish are rows the deciding run's
transaction writes on its own node, applied to the other run in a transaction of its own.

Where a test turns off the delivery right after commit (``no_eager``), the coordinator's
children loop delivers, and a step is made to fail where a process could die."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from composer_ops import Engine
from composer_ops.engine import childrows
from composer_ops.engine.ids import uuid7_text
from composer_ops.repo import deliveries
from composer_ops.testing.citus import CitusCluster
from composer_ops.testing.processes import wait_for
from tests.integration.test_children import (  # noqa: F401
    REFUND,
    claim,
    parent_spec,
    test_a_child_that_finishes_at_its_start_completes_the_node_in_the_same_transaction,
    test_a_child_whose_workflow_was_disabled_fails_the_node,
    test_a_failed_child_fails_the_parent,
    test_cancelling_the_parent_cancels_the_child_and_its_tasks,
    test_deploy_refuses_unknown_children_and_cycles,
    test_runs_show_links_parent_and_child_both_ways,
    test_the_child_runs_and_its_output_completes_the_parents_node,
)


@pytest.fixture
def no_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine that commits a child row does not deliver it: the coordinator's loop does."""
    monkeypatch.setattr(childrows, "drain", lambda shell: 0)


def rows(db_url: str) -> list[tuple[str, str, str]]:
    with psycopg.connect(db_url) as conn:
        return [(str(r[0]), str(r[1]), str(r[2])) for r in conn.execute(
            "SELECT run_id, target_run_id, kind FROM child_deliveries ORDER BY written_at").fetchall()]


def deliver(engine: Engine) -> int:
    """One pass of a fresh coordinator's children loop (no backoff left from another)."""
    stats = engine.coordinator().run_once(["children"])
    return stats.children_delivered


def dies_before_delete(monkeypatch: pytest.MonkeyPatch) -> None:
    def dead(*_: Any, **__: Any) -> bool:
        raise RuntimeError("the delivering process died here")
    monkeypatch.setattr(deliveries, "delete", dead)


def node_of(conn: psycopg.Connection[Any], run_id: str) -> int:
    """The port of the worker node holding ``run_id``'s shard."""
    row = conn.execute("SELECT nodeport FROM pg_dist_shard_placement "
                       "WHERE shardid = get_shard_id_for_distribution_column('workflow_runs', %s::text)",
                       (run_id,)).fetchone()
    assert row is not None
    return int(row[0])


@contextmanager
def runs_locked_on(cluster: CitusCluster, db_url: str, port: int) -> Iterator[None]:
    """Every workflow_runs shard of the worker node ``port`` locked against writes and row
    locks (EXCLUSIVE: plain reads still pass) until the block ends."""
    with psycopg.connect(db_url) as coord:
        shards = [int(r[0]) for r in coord.execute(
            "SELECT s.shardid FROM pg_dist_shard s JOIN pg_dist_shard_placement p USING (shardid) "
            "WHERE s.logicalrelid = 'workflow_runs'::regclass AND p.nodeport = %s", (port,)).fetchall()]
    assert shards
    (worker,) = [w for w in cluster.workers if w.port == port]
    with psycopg.connect(worker.url(str(conninfo_to_dict(db_url)["dbname"]))) as conn:
        conn.execute("SET citus.enable_manual_changes_to_shards = on")    # a lock, not a change
        conn.execute(sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(
            sql.SQL(", ").join(sql.Identifier(f"workflow_runs_{s}") for s in shards)))
        yield
        conn.rollback()


def in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test, which asserts on it
            result["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def node_state(conn: psycopg.Connection[Any], run_id: str, node_id: str) -> str:
    row = conn.execute("SELECT state FROM task_instances WHERE run_id = %s AND node_id = %s",
                       (run_id, node_id)).fetchone()
    assert row is not None
    return str(row[0])


def test_a_parent_and_its_child_on_two_nodes_each_commit_on_their_own_node(
        engine: Engine, db_url: str, citus_cluster: CitusCluster) -> None:
    """The parent's start commits while every run shard of the child's node is locked
    against writes, and the child's finish while the parent's node is: neither event
    writes the other run's node. The row is applied once the lock is gone."""
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    ports = {w.port for w in citus_cluster.workers if w.port is not None}
    with psycopg.connect(db_url, autocommit=True) as look:
        for _ in range(40):      # until a child lands on the other node than its parent (each time 1 in 2)
            parent = uuid7_text()
            home = node_of(look, parent)
            (other,) = ports - {home}
            with runs_locked_on(citus_cluster, db_url, other):
                thread, result = in_thread(engine.start, "order", input={"amount": 7}, run_id=parent)

                def pending_or_done(parent: str = parent, thread: threading.Thread = thread) -> Any:
                    found = look.execute("SELECT target_run_id FROM child_deliveries WHERE run_id = %s",
                                         (parent,)).fetchone()
                    return found or not thread.is_alive()
                found = wait_for(pending_or_done, timeout=60, what="the parent's start to commit")
                child = found[0] if isinstance(found, tuple) else None
                if child is None or node_of(look, child) == home:
                    thread.join(60)
                    continue
                # The parent committed; its child's start waits for the child's node.
                assert look.execute("SELECT status FROM workflow_runs WHERE id = %s", (parent,)).fetchone() == \
                    ("RUNNING",)
                assert node_state(look, parent, "refund") == "WAITING"
                assert look.execute("SELECT count(*) FROM workflow_runs WHERE id = %s", (child,)).fetchone() == (0,)
                assert thread.is_alive()
            thread.join(60)
            assert result == {"value": parent}
            break
        else:
            pytest.fail("no child landed on another node than its parent in 40 starts")
        assert engine.get_run(child).status == "RUNNING"
        assert rows(db_url) == []
        (task,) = [t for t in claim(engine) if t.run_id == child]    # earlier tries left children too
        with runs_locked_on(citus_cluster, db_url, home):
            thread, result = in_thread(engine.complete, task, {"refunded": 7})
            wait_for(lambda: look.execute("SELECT 1 FROM child_deliveries WHERE run_id = %s AND kind = 'finish'",
                                          (child,)).fetchone(), timeout=60, what="the child's finish to commit")
            assert look.execute("SELECT status FROM workflow_runs WHERE id = %s", (child,)).fetchone() == \
                ("SUCCEEDED",)
            assert node_state(look, parent, "refund") == "WAITING"
            assert thread.is_alive()
        thread.join(60)
        assert "error" not in result
    assert rows(db_url) == []
    (after,) = claim(engine)
    assert after.run_id == parent
    engine.complete(after, "done")
    assert engine.get_run(parent).status == "SUCCEEDED"


def test_a_delivery_that_dies_between_its_apply_and_its_delete_is_applied_again_as_a_no_op(
        engine: Engine, db_url: str, monkeypatch: pytest.MonkeyPatch, no_eager: None) -> None:
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    assert [k for _, _, k in rows(db_url)] == ["start"]
    real_delete = deliveries.delete
    dies_before_delete(monkeypatch)
    assert deliver(engine) == 0
    (child,) = engine.get_run(parent).children          # the start committed, its row stayed
    assert [k for _, _, k in rows(db_url)] == ["start"]
    monkeypatch.setattr(deliveries, "delete", real_delete)
    assert deliver(engine) == 1
    assert rows(db_url) == []
    assert len(engine.get_run(parent).children) == 1
    assert [h.kind for h in engine.get_run(child.id).history].count("started") == 1

    (task,) = claim(engine)
    engine.complete(task, {"refunded": 7})
    assert [k for _, _, k in rows(db_url)] == ["finish"]
    dies_before_delete(monkeypatch)
    assert deliver(engine) == 0
    assert [t.state for t in engine.get_run(parent).tasks if t.node_id == "refund"] == ["COMPLETED"]
    monkeypatch.setattr(deliveries, "delete", real_delete)
    assert deliver(engine) == 1
    assert rows(db_url) == []
    assert [h.kind for h in engine.get_run(parent).history].count("child_finished") == 1
    (after,) = claim(engine)                            # one 'after' task, not two
    engine.complete(after, "done")
    assert engine.get_run(parent).status == "SUCCEEDED"


def test_a_parent_cancelled_while_its_childs_start_is_pending_leaves_no_child_running(
        engine: Engine, db_url: str, no_eager: None) -> None:
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    engine.cancel(parent, reason="customer changed their mind")
    assert [k for _, _, k in rows(db_url)] == ["cancel"]     # the cancel replaced the start
    assert deliver(engine) >= 1
    wait_for(lambda: deliver(engine) == 0 and rows(db_url) == [], timeout=30, what="the rows to be delivered")
    assert claim(engine) == []
    (child,) = engine.get_run(parent).children
    assert child.status == "CANCELLED"
    assert engine.get_run(parent).status == "CANCELLED"


def test_a_parent_cancelled_after_its_childs_start_was_applied_but_not_deleted_cancels_the_child(
        engine: Engine, db_url: str, monkeypatch: pytest.MonkeyPatch, no_eager: None) -> None:
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    real_delete = deliveries.delete
    dies_before_delete(monkeypatch)
    assert deliver(engine) == 0
    (child,) = engine.get_run(parent).children
    assert child.status == "RUNNING"
    monkeypatch.setattr(deliveries, "delete", real_delete)
    engine.cancel(parent, reason="customer changed their mind")
    wait_for(lambda: deliver(engine) == 0 and rows(db_url) == [], timeout=30, what="the rows to be delivered")
    kid = engine.get_run(child.id)
    assert kid.status == "CANCELLED"
    assert [t.state for t in kid.tasks] == ["CANCELLED"]
    assert claim(engine) == []


def test_a_child_whose_workflow_is_disabled_before_its_start_is_delivered_fails_the_node(
        engine: Engine, db_url: str, no_eager: None) -> None:
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    engine.set_enabled("refund", False)
    assert deliver(engine) == 1
    run = engine.get_run(parent)
    assert run.status == "FAILED"
    assert run.error["error"] == ('node "refund" failed: its child did not start: workflow \'refund\' is '
                                  "disabled; it accepts no new runs"), run.error     # no run named: none exists
    assert run.children == []
    assert rows(db_url) == []


def test_a_child_that_finishes_at_its_start_completes_the_node_through_the_loop(
        engine: Engine, db_url: str, no_eager: None) -> None:
    engine.deploy({"id": "instant", "nodes": [{"id": "none", "type": "MAP", "items": "$.input.ids", "task": "x"}]})
    engine.deploy({"id": "outer", "nodes": [
        {"id": "call", "type": "SUB_WORKFLOW", "workflow": "instant", "input": {"ids": []}}]})
    parent = engine.start("outer")
    assert [k for _, _, k in rows(db_url)] == ["start"]
    assert deliver(engine) == 1
    assert [k for _, _, k in rows(db_url)] == ["finish"]      # written by the child's start, on its node
    assert deliver(engine) == 1
    run = engine.get_run(parent)
    assert (run.status, run.output) == ("SUCCEEDED", {"call": {"none": []}})
    assert rows(db_url) == []


def test_a_round_trip_through_a_running_coordinator(engine: Engine, db_url: str, no_eager: None) -> None:
    """Parent -> child -> parent with the coordinator's loop as the only delivery."""
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    coordinator = engine.coordinator(interval=0.05)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    try:
        parent = engine.start("order", input={"amount": 7})
        (task,) = wait_for(lambda: claim(engine), timeout=60, what="the child's task")
        assert task.run_id != parent
        engine.complete(task, {"refunded": 7})
        (after,) = wait_for(lambda: claim(engine), timeout=60, what="the parent's next task")
        assert (after.run_id, after.input) == (parent, {"refund": {"pay_back": {"refunded": 7}}})
        engine.complete(after, "done")
    finally:
        coordinator.stop()
        thread.join(60)
    assert engine.get_run(parent).status == "SUCCEEDED"


def test_a_childs_finish_outlives_the_childs_month(engine: Engine, db_url: str, no_eager: None) -> None:
    """Retention with a pending row: the row's parent waits (an active run, whose month
    retention keeps), the finished child's month may be dropped first (its rows are
    deleted here, as the drop would); the row references no run and still completes
    the parent."""
    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    assert deliver(engine) == 1
    (task,) = claim(engine)
    child = task.run_id
    engine.complete(task, {"refunded": 7})
    assert rows(db_url) == [(child, parent, "finish")]
    with psycopg.connect(db_url) as conn:
        for table, column in (("run_history", "run_id"), ("task_instances", "run_id"), ("workflow_runs", "id")):
            conn.execute(sql.SQL("DELETE FROM {} WHERE {} = %s").format(sql.Identifier(table), sql.Identifier(column)),
                         (child,))
    assert deliver(engine) == 1
    assert rows(db_url) == []
    (after,) = claim(engine)
    assert (after.run_id, after.input) == (parent, {"refund": {"pay_back": {"refunded": 7}}})


def test_a_failed_child_whose_finish_is_on_its_way_is_left_to_its_parent(
        engine: Engine, db_url: str, no_eager: None, capsys: pytest.CaptureFixture[str]) -> None:
    """On Citus a child's finish reaches its parent as a row the coordinator's loop
    delivers. Between the two the parent is RUNNING and its node still waits for this
    child: a retry of the child then would run its work, and the parent, given the first
    finish, would fail and its own retry run the work again. Refused, by one run's retry
    and a bulk retry alike, until the parent has the finish; then refused as the child
    of a FAILED parent (core/rerun.child_left_to_parent, unit-tested in
    tests/unit/test_machine_retry.py; this is the state only Citus makes)."""
    from composer_ops.cli import main
    from composer_ops.errors import Conflict

    engine.deploy(REFUND)
    engine.deploy(parent_spec())
    parent = engine.start("order", input={"amount": 7})
    assert deliver(engine) == 1
    (task,) = claim(engine)
    child = task.run_id
    engine.fail(task, "bank says no", retryable=False)
    assert rows(db_url) == [(child, parent, "finish")]
    assert (engine.get_run(child).status, engine.get_run(parent).status) == ("FAILED", "RUNNING")
    with psycopg.connect(db_url) as conn:
        assert node_state(conn, parent, "refund") == "WAITING"

    on_its_way = (f"run {child} is the child of run {parent} .node \"refund\"., whose node still waits for its "
                  f"finish .on its way to the parent.")
    with pytest.raises(Conflict, match=on_its_way):
        engine.retry(child)
    assert main(["runs", "retry", "--since", "1h", "--json", "--database-url", db_url]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in dry["left_to_parent"]] == [child], dry
    assert "on its way to the parent" in dry["left_to_parent"][0]["why"], dry
    assert dry["retried"] == [] and dry["refused"] == [], dry      # the parent is RUNNING: not selected
    assert main(["runs", "retry", "--since", "1h", "--yes", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("retried 0 run(s), 0 refused, 1 child run(s) left to their parent"), out
    assert engine.get_run(child).status == "FAILED" and claim(engine) == []       # nothing ran again

    assert deliver(engine) == 1
    assert rows(db_url) == []
    assert engine.get_run(parent).status == "FAILED"
    with pytest.raises(Conflict, match=f"run {child} is the child of run {parent} .node \"refund\"., which is FAILED"):
        engine.retry(child)
    engine.retry(parent, "refund")
    assert deliver(engine) == 1
    (again,) = claim(engine)
    assert again.run_id not in (child, parent)
    engine.complete(again, {"refunded": 7})
    assert deliver(engine) == 1
    (after,) = claim(engine)
    engine.complete(after, "done")
    assert (engine.get_run(parent).status, engine.get_run(child).status) == ("SUCCEEDED", "FAILED")
