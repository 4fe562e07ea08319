"""A worker's report claims its next tasks in its own transaction (``claim_next``).

``Engine.complete`` and ``Engine.fail`` take ``claim_next`` (``Engine.next_claim``): the
claim goes in the round trip of the event's one write and COMMIT, so a completion and
the claim that follows it are one transaction. A worker makes that claim when it was
woken for tasks; its slot then runs the task it got without waiting for the claim loop.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, Worker
from composer_ops.engine import report_claim
from composer_ops.engine.worker import Result
from composer_ops.testing.processes import wait_for

CHAIN = {"id": "chain", "nodes": [{"id": "a", "type": "TASK", "task": "t"},
                                  {"id": "b", "type": "TASK", "task": "t", "depends_on": ["a"]}]}
ONE = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]}


def _transactions(db_url: str, run_id: str) -> dict[tuple[str, str], str]:
    """(kind, node) -> the transaction that wrote that history row of ``run_id``."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT kind, node_id, xmin::text FROM run_history WHERE run_id = %s "
                            "AND kind IN ('claimed', 'completed', 'failed')", (run_id,)).fetchall()
    return {(str(kind), str(node)): str(xid) for kind, node, xid in rows}


def test_a_completion_claims_the_task_it_dispatched_in_its_transaction(db_url: str, engine: Engine) -> None:
    engine.deploy(CHAIN)
    run_id = engine.start("chain")
    (first,) = engine.claim(["default"], "w1", 1)
    outcome = engine.complete(first, {"ok": 1}, claim_next=engine.next_claim(["default"], "w1", 1, ["t"]))
    assert outcome.applied and outcome.claimed is not None
    assert [(c.run_id, c.node_id, c.attempt, c.lease_owner) for c in outcome.claimed] == [(run_id, "b", 0, "w1")]
    states = {t.node_id: t.state for t in engine.get_run(run_id).tasks}
    assert states == {"a": "COMPLETED", "b": "RUNNING"}
    xids = _transactions(db_url, run_id)
    assert xids[("completed", "a")] == xids[("claimed", "b")], xids
    engine.complete(outcome.claimed[0], None)
    assert engine.get_run(run_id).status == "SUCCEEDED"


def test_a_failure_claims_another_runs_task(db_url: str, engine: Engine) -> None:
    engine.deploy(ONE)
    failing, waiting = engine.start("one"), engine.start("one")
    (first,) = engine.claim(["default"], "w1", 1)
    assert first.run_id == failing
    outcome = engine.fail(first, "fatal", retryable=False, claim_next=engine.next_claim(["default"], "w1", 1))
    assert outcome.claimed is not None and [c.run_id for c in outcome.claimed] == [waiting]
    assert engine.get_run(failing).status == "FAILED"
    assert _transactions(db_url, failing)[("failed", "a")] == _transactions(db_url, waiting)[("claimed", "a")]


def test_a_stale_report_claims_nothing(engine: Engine) -> None:
    """A report that changes nothing (its attempt was already reported) writes nothing:
    no claim is made (``Outcome.claimed`` is None), and the ready task stays ready."""
    engine.deploy(ONE)
    engine.start("one")
    (first,) = engine.claim(["default"], "w1", 1)
    engine.complete(first, None)
    ready = engine.start("one")
    again = engine.complete(first, None, claim_next=engine.next_claim(["default"], "w1", 1))
    assert again.stale and again.claimed is None
    assert [t.state for t in engine.get_run(ready).tasks] == ["PENDING"]
    assert [c.run_id for c in engine.claim(["default"], "w2", 1)] == [ready]


def test_a_busy_worker_claims_with_its_reports_and_runs_every_task_once(db_url: str, engine: Engine) -> None:
    """A backlog of 40 ready runs, one worker of 2 slots, no dispatch after it starts:
    the first claim fills the slots and hands the worker a wake-up for the rest, each
    report claims the next task in its transaction (and hands another), until the
    backlog is drained. Every task runs once; some claims share a completion's
    transaction (those the claim loop makes instead, when a wake-up is late, are as good)."""
    engine.deploy(ONE)
    runs = [engine.start("one") for _ in range(40)]
    results: list[Result] = []
    with Engine.connect(db_url, pool_size=3) as w_engine:
        worker = Worker(w_engine, concurrency=2, poll_interval=0.5, on_result=results.append)
        worker.handler("t")(lambda _input, _ctx: {"ok": True})
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: len(results) >= len(runs), timeout=120, what="every run's report")
        finally:
            worker.stop()
            thread.join(60)
    assert sorted(r.status for r in results) == ["completed"] * len(runs)
    assert {engine.get_run(r).status for r in runs} == {"SUCCEEDED"}
    with psycopg.connect(db_url) as conn:
        claimed = conn.execute("SELECT run_id, count(*) FROM run_history WHERE kind = 'claimed' "
                               "GROUP BY run_id").fetchall()
        shared = conn.execute("""
            SELECT count(*) FROM run_history c
             WHERE c.kind = 'claimed'
               AND EXISTS (SELECT 1 FROM run_history d WHERE d.kind = 'completed' AND d.xmin = c.xmin
                              AND d.run_id <> c.run_id)""").fetchone()
    assert sorted(claimed) == sorted((r, 1) for r in runs)
    assert shared is not None and shared[0] >= 1, "no task was claimed with a report"
    counts: dict[str, Any] = worker.claim_counts()
    assert sum(c["claims"] - c["empty"] for c in counts.values()) <= len(runs), counts


class _OneClaimWorker(Worker):
    """A worker whose claim loop claims once, then waits for stop(): what it runs after
    its first task is what its reports claim."""

    def _claim_loop(self, slots: Any) -> None:
        self._adopt_registration()
        self._await_listening()
        claims = self.engine.claim(self.queues, self.worker_id, 1, task_names=list(self._handlers),
                                   wake=self._wake_channel, room=self.concurrency, seen=0)
        self._hand_out(claims, time.monotonic(), slots)
        self._stop.wait()


def test_tasks_a_report_claims_for_free_slots_run_when_the_worker_stops_meanwhile(
        db_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report that claims for the free slots as well as its own, with stop() arriving
    while its claim is on its way: run() hands the tasks to the free slots before it
    ends them, so every task claimed runs and run() returns without waiting out its
    shutdown timeout (it would otherwise find them in flight and never run)."""
    engine.deploy(ONE)
    first = engine.start("one")
    go = threading.Event()
    results: list[Result] = []
    with Engine.connect(db_url, pool_size=5) as w_engine:
        worker = _OneClaimWorker(w_engine, concurrency=3, poll_interval=3600.0, on_result=results.append,
                                 shutdown_timeout=30.0)
        worker.handler("t")(lambda _input, ctx: go.wait(30) if ctx.run_id == first else None)
        ask = report_claim.ReportClaim.ask

        def ask_then_stop(self: Any) -> Any:
            asked = ask(self)
            if asked is not None:
                worker.stop()            # while the claim is on its way
            return asked

        monkeypatch.setattr(report_claim.ReportClaim, "ask", ask_then_stop)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: [t.state for t in engine.get_run(first).tasks] == ["RUNNING"], what="the first task")
            more = [engine.start("one") for _ in range(4)]
            wait_for(lambda: worker._promised >= 2, what="the wake-ups for the free slots")
            go.set()
            began = time.monotonic()
            thread.join(60)
            assert not thread.is_alive()
            assert time.monotonic() - began < 20, "run() waited out its shutdown timeout"
        finally:
            go.set()
            worker.stop()
            thread.join(60)
    done = [r.claim.run_id for r in results if r.status == "completed"]
    assert first in done and len(done) == 4, (done, more)
    with psycopg.connect(db_url) as conn:
        held = conn.execute("SELECT count(*) FROM task_instances WHERE state = 'RUNNING'").fetchone()
    assert held == (0,)


def test_a_report_held_up_leaves_the_free_slots_to_the_claim_loop_soon(db_url: str, engine: Engine) -> None:
    """The claim loop leaves free slots to reports under way, which claim for them in
    their transactions, only for a moment (``REPORT_WAIT_S``): a report held up (here
    its run's row is locked elsewhere) must not keep a ready task from a free slot until
    it ends."""
    engine.deploy(ONE)
    held = engine.start("one")
    locked = threading.Event()
    results: list[Result] = []
    with Engine.connect(db_url, pool_size=5) as w_engine, psycopg.connect(db_url) as locker:
        worker = Worker(w_engine, concurrency=2, poll_interval=3600.0, on_result=results.append)
        worker.handler("t")(lambda _input, ctx: locked.wait(30) if ctx.run_id == held else None)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: [t.state for t in engine.get_run(held).tasks] == ["RUNNING"], what="the held run's task")
            locker.execute("SELECT 1 FROM workflow_runs WHERE id = %s FOR UPDATE", (held,))
            locked.set()                 # its report now waits for the run's lock
            wait_for(lambda: worker._reports_under_way(), what="the held-up report")
            ready = engine.start("one")
            wait_for(lambda: engine.get_run(ready).status == "SUCCEEDED", timeout=30,
                     what="the ready run, claimed for the free slot while the report waits")
            assert engine.get_run(held).status == "RUNNING"
        finally:
            locked.set()
            locker.rollback()
            wait_for(lambda: len(results) >= 2, timeout=60, what="both reports")
            worker.stop()
            thread.join(60)
    assert engine.get_run(held).status == "SUCCEEDED"
