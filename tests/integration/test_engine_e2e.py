"""End to end through real worker and coordinator processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from composer_ops import Engine
from composer_ops.testing.processes import TERMINAL, Fleet, wait_for

# Each test starts worker and coordinator processes: on a loaded machine, a minute or more.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def order_spec(wait_s: float = 0.5, timeout_s: float = 60) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((ROOT / "examples" / "order_fulfilment.json").read_text())
    nodes = {n["id"]: n for n in spec["nodes"]}
    nodes["charge"]["task"] = "tier"
    nodes["charge"]["retry"]["initial_backoff_s"] = 0.1
    nodes["cool_off"]["duration_s"] = wait_s
    nodes["delivered"]["timeout_s"] = timeout_s
    return spec


def fleet(db_url: str, *, workers: int = 1, coordinators: int = 1) -> Fleet:
    f = Fleet(db_url)
    for _ in range(workers):
        f.worker()
    for _ in range(coordinators):
        f.coordinator()
    return f


def finished(engine: Engine, run_id: str, timeout: float = 120) -> Any:
    return wait_for(lambda: (r := engine.get_run(run_id)).status in TERMINAL and r, timeout, what=f"run {run_id}")


def states(run: Any) -> dict[str, str]:
    return {t.node_id: t.state for t in run.tasks}


def test_order_fulfilment_both_switch_branches_and_signal_before_and_after_wait(db_url: str, engine: Engine) -> None:
    engine.deploy(order_spec())
    gold = engine.start("order-fulfilment", input={"amount": 500})
    engine.signal(gold, "delivered", {"proof": "early"})            # before the node waits: buffered
    basic = engine.start("order-fulfilment", input={"amount": 5})
    with fleet(db_url):
        wait_for(lambda: states(engine.get_run(basic)).get("delivered") == "WAITING", what="basic waiting")
        engine.signal(basic, "delivered", {"proof": "late"})        # after: resolves the waiting node
        g, b = finished(engine, gold), finished(engine, basic)
    assert (g.status, b.status) == ("SUCCEEDED", "SUCCEEDED")
    assert states(g)["express"] == "COMPLETED" and states(g)["standard"] == "SKIPPED"
    assert states(b)["express"] == "SKIPPED" and states(b)["standard"] == "COMPLETED"
    assert g.output["notify"]["input"] == {"proof": {"proof": "early"}}
    assert b.output["notify"]["input"] == {"proof": {"proof": "late"}}
    assert all(len([t for t in r.tasks if t.node_id == "notify"]) == 1 for r in (g, b))


@pytest.mark.parametrize(("on_timeout", "status", "node_state"), [
    ("fail", "FAILED", "FAILED"), ("continue", "SUCCEEDED", "COMPLETED")])
def test_wait_for_event_timeout_both_ways(db_url: str, engine: Engine, on_timeout: str, status: str,
                                          node_state: str) -> None:
    engine.deploy({"id": "approval", "nodes": [
        {"id": "ask", "type": "WAIT_FOR_SIGNAL", "signal": "approved", "timeout_s": 0.5, "on_timeout": on_timeout},
        {"id": "after", "type": "TASK", "task": "work", "depends_on": ["ask"]}]})
    run_id = engine.start("approval")
    with fleet(db_url):
        run = finished(engine, run_id)
    assert run.status == status
    assert states(run)["ask"] == node_state
    if status == "FAILED":
        assert "timed out" in json.dumps(run.error)
        assert "after" not in states(run)


def test_retries_then_success_and_retries_exhausted_and_non_retryable(db_url: str, engine: Engine) -> None:
    def spec(wf: str, behaviour: dict[str, Any]) -> dict[str, Any]:
        return {"id": wf, "nodes": [{"id": "step", "type": "TASK", "task": "work", "input": behaviour,
                                     "retry": {"max_attempts": 3, "initial_backoff_s": 0.05,
                                               "multiplier": 2, "max_backoff_s": 0.2}}]}
    engine.deploy(spec("recovers", {"fail_until": 2}))
    engine.deploy(spec("exhausts", {"fail_until": 5}))
    engine.deploy(spec("fatal", {"fatal": True}))
    ids = {wf: engine.start(wf) for wf in ("recovers", "exhausts", "fatal")}
    with fleet(db_url):
        runs = {wf: finished(engine, rid) for wf, rid in ids.items()}
    assert runs["recovers"].status == "SUCCEEDED" and runs["recovers"].tasks[0].attempt == 2
    assert runs["exhausts"].status == "FAILED" and runs["exhausts"].tasks[0].attempt == 2
    assert "transient failure on attempt 2" in json.dumps(runs["exhausts"].tasks[0].error)
    assert runs["fatal"].status == "FAILED" and runs["fatal"].tasks[0].attempt == 0
    assert "fatal by request" in json.dumps(runs["fatal"].error)


def test_cancel_during_a_running_task_makes_its_late_result_stale(db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "slow", "nodes": [{"id": "s", "type": "TASK", "task": "slow", "input": {"sleep": 1.5}},
                                           {"id": "next", "type": "TASK", "task": "work", "depends_on": ["s"]}]})
    run_id = engine.start("slow")
    with fleet(db_url):
        wait_for(lambda: states(engine.get_run(run_id)).get("s") == "RUNNING", what="task running")
        engine.cancel(run_id, reason="operator said so")
        run = engine.get_run(run_id)
        assert (run.status, states(run)) == ("CANCELLED", {"s": "CANCELLED"})
        wait_for(lambda: _pending_outbox(engine) == 0, what="outbox drained")
        import time
        time.sleep(2.0)                                   # the handler finishes and reports
    after = engine.get_run(run_id)
    assert (after.status, states(after)) == ("CANCELLED", {"s": "CANCELLED"})
    assert after.tasks[0].output is None


def _pending_outbox(engine: Engine) -> int:
    with engine.pool.connection() as conn:
        row = conn.execute("SELECT count(*) FROM task_outbox").fetchone()
        assert row is not None
        return int(row[0])


def test_sigkilled_worker_task_is_retried_after_its_lease(db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "victim", "nodes": [
        {"id": "long", "type": "TASK", "task": "slow", "input": {"sleep": 1.0}, "lease_s": 2,
         "retry": {"max_attempts": 3, "initial_backoff_s": 0.1}}]})
    run_id = engine.start("victim")
    with Fleet(db_url) as c:
        c.coordinator()
        first = c.worker()
        wait_for(lambda: states(engine.get_run(run_id)).get("long") == "RUNNING", what="claimed")
        owner = engine.get_run(run_id).tasks[0].lease_owner
        c.kill(first)
        c.worker()
        run = finished(engine, run_id, timeout=30)
    assert run.status == "SUCCEEDED"
    task = run.tasks[0]
    assert task.attempt == 1
    assert "lease" in json.dumps(task.error or {}) or task.error is None
    assert run.output["long"]["pid"] != int(str(owner).split(":")[1])


def test_fan_out_fan_in_200_runs_4_workers_2_coordinators(db_url: str, engine: Engine) -> None:
    width = 8
    nodes: list[dict[str, Any]] = [{"id": "split", "type": "TASK", "task": "work"}]
    nodes += [{"id": f"b{i}", "type": "TASK", "task": "work", "depends_on": ["split"]} for i in range(width)]
    nodes += [{"id": "join", "type": "TASK", "task": "work", "depends_on": [f"b{i}" for i in range(width)]}]
    engine.deploy({"id": "fan", "nodes": nodes})
    with fleet(db_url, workers=4, coordinators=2):
        ids = [engine.start("fan", input={"n": i}) for i in range(200)]
        wait_for(lambda: _count(engine, "SELECT count(*) FROM workflow_runs WHERE status = 'SUCCEEDED'") == 200
                 or _count(engine, "SELECT count(*) FROM workflow_runs WHERE status IN ('FAILED','CANCELLED')"),
                 timeout=120, interval=0.5, what="200 runs")
    assert _count(engine, "SELECT count(*) FROM workflow_runs WHERE status = 'SUCCEEDED'") == 200
    assert _count(engine, "SELECT count(*) FROM task_instances") == 200 * (width + 2)
    assert _count(engine, """SELECT count(*) FROM (SELECT run_id, node_id FROM task_instances
                             GROUP BY 1, 2 HAVING count(*) > 1) d""") == 0
    assert _count(engine, "SELECT count(*) FROM task_instances WHERE node_id = 'join' AND state = 'COMPLETED'"
                          " AND attempt = 0") == 200
    assert len(set(ids)) == 200


def _count(engine: Engine, query: str) -> int:
    with engine.pool.connection() as conn:
        row = conn.execute(query).fetchone()
        assert row is not None
        return int(row[0])
