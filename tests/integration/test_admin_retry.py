"""Retry from a node on the real engine, for each node type (TASK, a SWITCH branch, WAIT,
WAIT_FOR_SIGNAL, a join), step by step against the pure machine driven in memory with
the same events; refusals; the dry run writes nothing; the audit row and the webhook."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.core.model import CancelRun, ResetTasks, RunStatus
from composer_ops.errors import Conflict, Invalid, NotFound
from composer_ops.repo.rows import Claim
from tests.unit.machine_sim import Sim

WAIT_S = 0.3
EVENT_WAIT_S = 5.0


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=4) as e:
        yield e


@dataclass
class Twin:
    """One run on the real engine and the same run in the pure machine, driven alike."""

    engine: Engine
    sim: Sim
    run_id: str

    def _claim(self, node: str) -> Claim:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            claims = self.engine.claim(["default"], "w1", 1, task_names=[f"do.{node}"])
            if claims:
                assert claims[0].node_id == node and claims[0].run_id == self.run_id
                return claims[0]
            time.sleep(0.05)
        raise AssertionError(f"{node} could not be claimed")

    def complete(self, node: str, output: Any = None) -> None:
        self.engine.complete(self._claim(node), output)
        self.sim.complete(node, output)
        self.check()

    def fail(self, node: str) -> None:
        self.engine.fail(self._claim(node), "broken", retryable=False)
        self.sim.fail(node, "broken", retryable=False)
        self.check()

    def timer(self, node: str, wait_s: float = WAIT_S) -> None:
        time.sleep(wait_s + 0.1)
        stats = self.engine.coordinator().run_once(["timers"])
        assert stats.timers_fired == 1, stats
        self.sim.tick(wait_s + 0.1)
        self.sim.fire(node)
        self.check()

    def signal(self, name: str, payload: Any) -> None:
        self.engine.signal(self.run_id, name, payload)
        self.sim.signal(name, payload)
        self.check()

    def cancel(self) -> None:
        self.engine.cancel(self.run_id, reason="stop")
        self.sim.send(CancelRun(reason="stop", now=self.sim.now))
        self.check()

    def retry(self, *nodes: str) -> None:
        result = self.engine.retry(self.run_id, list(nodes) or None)
        decision = self.sim.retry(*nodes)
        reset = [a.node_ids for a in decision.actions if isinstance(a, ResetTasks)]
        assert result.reset == (reset[0] if reset else ())
        self.check()

    def check(self) -> None:
        """The engine's run equals the machine's: status, and each node's state, attempt and output."""
        run = self.engine.get_run(self.run_id)
        real = {t.node_id: (t.state, t.attempt, t.output) for t in run.tasks}
        model = {n: (str(r.state), r.attempt, r.output) for n, r in self.sim.rows.items()}
        assert (run.status, real) == (str(self.sim.status), model)


def twin(engine: Engine, spec: dict[str, Any], input: Any = None) -> Twin:
    engine.deploy(spec)
    run_id = engine.start(spec["id"], input=input)
    sim = Sim(spec, input=input, run_id=run_id)
    sim.start()
    pair = Twin(engine, sim, run_id)
    pair.check()
    return pair


def t(node_id: str, *deps: str, **extra: Any) -> dict[str, Any]:
    return {"id": node_id, "type": "TASK", "task": f"do.{node_id}", "depends_on": list(deps), **extra}


def test_retry_a_task(engine: Engine) -> None:
    run = twin(engine, {"id": "tasks", "nodes": [t("a"), t("b", "a", input={"x": "$.nodes.a.output.x"}),
                                                t("c", "b")]})
    run.complete("a", {"x": 7})
    run.fail("b")
    run.retry()
    assert engine.get_run(run.run_id).status == "RUNNING"
    run.complete("b", {"y": 1})
    run.complete("c", "done")
    assert run.sim.status is RunStatus.SUCCEEDED
    b = next(x for x in engine.get_run(run.run_id).tasks if x.node_id == "b")
    assert b.input == {"x": 7}                     # resolved again from the kept upstream output


def test_retry_from_a_switch_branch(engine: Engine) -> None:
    run = twin(engine, {"id": "orders", "nodes": [
        t("charge"),
        {"id": "route", "type": "SWITCH", "depends_on": ["charge"], "expression": "$.nodes.charge.output.tier",
         "cases": {"gold": ["express"]}, "default": ["standard"]},
        t("express", "route"), t("standard", "route"), t("notify", "express", "standard")]})
    run.complete("charge", {"tier": "gold"})
    run.fail("express")
    with pytest.raises(Invalid, match='node "express" failed the run'):
        engine.retry(run.run_id, "notify")
    run.retry("route")
    run.complete("express", "shipped")
    run.complete("notify")


def test_retry_a_cancelled_wait(engine: Engine) -> None:
    run = twin(engine, {"id": "pauses", "nodes": [
        t("a"), {"id": "pause", "type": "WAIT", "depends_on": ["a"], "duration_s": WAIT_S}, t("b", "pause")]})
    run.complete("a", 1)
    run.cancel()
    run.retry()
    run.timer("pause")
    run.complete("b")


def test_retry_a_timed_out_wait_for_event(engine: Engine) -> None:
    # The retried node waits again with the same timeout, and the signal must beat it by
    # the database clock: 0.3 s was lost on a loaded machine between the retry and the signal.
    run = twin(engine, {"id": "approvals", "nodes": [
        {"id": "ask", "type": "WAIT_FOR_SIGNAL", "signal": "approved", "timeout_s": EVENT_WAIT_S}, t("go", "ask")]})
    run.timer("ask", EVENT_WAIT_S)
    assert run.sim.status is RunStatus.FAILED
    run.retry()
    run.signal("approved", {"by": "ops"})
    run.complete("go")


def test_retry_before_a_join(engine: Engine) -> None:
    run = twin(engine, {"id": "joins", "nodes": [t("a"), t("b"), t("c", "a", "b")]})
    run.complete("a", 1)
    run.fail("b")
    run.retry()
    run.complete("b", 2)
    run.complete("c", 3)
    assert [x.node_id for x in engine.get_run(run.run_id).tasks].count("c") == 1


def test_refusals_change_nothing(db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "one", "nodes": [t("a")]})
    active = engine.start("one")
    with pytest.raises(Conflict, match="RUNNING: only a FAILED or CANCELLED run"):
        engine.retry(active)
    claim = engine.claim(["default"], "w", 1)[0]
    engine.complete(claim, 1)
    with pytest.raises(Conflict, match="SUCCEEDED"):
        engine.retry(active)
    failed = engine.start("one")
    engine.fail(engine.claim(["default"], "w", 1)[0], "x", retryable=False)
    with pytest.raises(Invalid, match='has no node "zz"'):
        engine.retry(failed, "zz")
    engine.delete("one")
    with pytest.raises(Invalid, match="was deleted"):
        engine.retry(failed)
    with pytest.raises(NotFound):
        engine.retry("0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e8f")
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM operator_audit").fetchone() == (0,)
    assert engine.get_run(failed).status == "FAILED"


def test_dry_run_writes_nothing_then_retry_with_audit_row_and_a_new_webhook(
        db_url: str, engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    engine.deploy({"id": "hooked", "webhook_url": "https://example.invalid/hook", "nodes": [t("a"), t("b", "a")]})
    run_id = engine.start("hooked")
    engine.complete(engine.claim(["default"], "w", 1)[0], "ok")
    engine.fail(engine.claim(["default"], "w", 1)[0], "bad", retryable=False)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE webhook_deliveries SET delivered_at = now()")
        first = conn.execute("SELECT id, payload->>'status' FROM webhook_deliveries").fetchone()
    assert first is not None and first[1] == "FAILED"
    before = engine.get_run(run_id)
    assert main(["runs", "retry", run_id, "--database-url", db_url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["applied"], out["reset"], out["created"]) == (False, ["b"], ["b"])
    assert engine.get_run(run_id) == before
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM operator_audit").fetchone() == (0,)
    assert main(["runs", "retry", run_id, "--from", "b", "--yes", "--database-url", db_url]) == 0
    assert "run again" in capsys.readouterr().out
    engine.complete(engine.claim(["default"], "w", 1)[0], "fixed")
    assert engine.get_run(run_id).status == "SUCCEEDED"
    with psycopg.connect(db_url) as conn:
        action, target, counts, command = conn.execute(
            "SELECT action, target, counts, command FROM operator_audit").fetchone()  # type: ignore[misc]
        again = conn.execute("SELECT id, payload->>'status', delivered_at FROM webhook_deliveries").fetchone()
    assert (action, target, counts) == ("runs retry", run_id, {"reset": 1, "created": 1})
    assert command.startswith(f"composer-ops runs retry {run_id} --from b --yes")
    assert again is not None and again[0] != first[0] and again[1:] == ("SUCCEEDED", None)
    assert main(["runs", "retry", run_id, "--database-url", db_url]) == 1      # SUCCEEDED now
    with pytest.raises(SystemExit) as bad:                     # argparse's one line, before connecting
        main(["runs", "retry", "not-a-run", "--database-url", db_url])
    assert bad.value.code == 2


def test_the_engine_role_retries_through_the_bounded_function_only(db_url: str) -> None:
    """The engine role cannot DELETE tasks; composer_reset_tasks removes only finished
    tasks of a finished run, which is what a retry needs, and the whole retry, cancel
    and audit work as that role."""
    from tests.integration.test_roles import ENGINE_ROLE
    from tests.notebooks.harness import as_role

    with Engine.connect(as_role(db_url, ENGINE_ROLE), pool_size=2) as engine:
        engine.deploy({"id": "roles", "nodes": [t("a"), t("b", "a")]})
        run_id = engine.start("roles")
        a = engine.claim(["default"], "w", 1)[0]
        with psycopg.connect(as_role(db_url, ENGINE_ROLE)) as conn:
            # An active run: nothing removed, whatever the caller names.
            assert conn.execute("SELECT composer_reset_tasks(%s, %s)", (run_id, [a.task_id])).fetchone() == (0,)
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("DELETE FROM task_instances WHERE run_id = %s", (run_id,))
        engine.complete(a, 1)
        engine.fail(engine.claim(["default"], "w", 1)[0], "x", retryable=False)
        assert engine.retry(run_id).reset == ("b",)
        engine.complete(engine.claim(["default"], "w", 1)[0], 2)
        assert engine.get_run(run_id).status == "SUCCEEDED"
        other = engine.start("roles")
        assert engine.cancel_runs(workflow="roles", yes=True).cancelled == [other]
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT action, db_role FROM operator_audit ORDER BY id").fetchall()
    assert rows == [("runs retry", ENGINE_ROLE), ("runs cancel", ENGINE_ROLE)]


def test_bulk_retry_of_a_selection(db_url: str, engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    engine.deploy({"id": "bulk", "nodes": [t("a")]})
    engine.deploy({"id": "gone", "nodes": [t("a")]})

    def failed(workflow: str) -> str:
        run_id = engine.start(workflow, input={"batch": 1})
        claim = engine.claim(["default"], "w", 1, task_names=["do.a"])[0]
        assert claim.run_id == run_id
        engine.fail(claim, "x", retryable=False)
        return run_id

    runs = [failed("bulk") for _ in range(3)]
    stale = failed("gone")
    cancelled = engine.start("bulk", input={"batch": 1})
    engine.cancel(cancelled)
    engine.delete("gone")
    base = ["runs", "retry", "--database-url", db_url, "--where", "input.batch=1"]
    assert main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(r["run_id"] for r in out["retried"]) == sorted(runs)
    assert [r["run_id"] for r in out["refused"]] == [stale] and "was deleted" in out["refused"][0]["error"]
    assert {engine.get_run(r).status for r in runs} == {"FAILED"}                 # a dry run
    assert main([*base, "--yes"]) == 0
    assert "retried 3 run(s), 1 refused" in capsys.readouterr().out
    assert {engine.get_run(r).status for r in runs} == {"RUNNING"}
    assert engine.get_run(cancelled).status == "CANCELLED"
    assert main([*base, "--status", "CANCELLED", "--yes", "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["retried"]] == [cancelled]
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM operator_audit WHERE action = 'runs retry'").fetchone() == (4,)
    assert main([*base, "--status", "SUCCEEDED"]) == 2
    assert main(["runs", "retry", runs[0], "--where", "input.batch=1", "--database-url", db_url]) == 2
    assert main(["runs", "retry", "--database-url", db_url]) == 2
