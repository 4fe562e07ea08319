"""A lease expiry is not a handler failure: the task is re-queued as a new attempt
without consuming its retry policy, up to ``max_lease_expiries``; the history says
whose lease it was."""

from __future__ import annotations

from typing import Any

import psycopg

from composer_ops import Engine
from composer_ops.repo.rows import Claim


def _lapse(db_url: str, run_id: str) -> None:
    """The claimed task's holder died: its lease is in the past by the database clock."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE task_instances SET lease_expires_at = now() - interval '1 second' "
                     "WHERE run_id = %s AND state = 'RUNNING'", (run_id,))


def _crash(engine: Engine, db_url: str, run_id: str, owner: str) -> Claim:
    [claim] = engine.claim(["default"], owner, 1)
    assert claim.run_id == run_id
    _lapse(db_url, run_id)
    stats = engine.coordinator().run_once()
    assert (stats.leases_expired, stats.errors) == (1, [])
    return claim


def _task(engine: Engine, run_id: str) -> Any:
    return engine.get_run(run_id).tasks[0]


def test_with_the_default_policy_a_crashed_workers_task_is_retried(engine: Engine, db_url: str) -> None:
    """max_attempts 1 (the default): no handler failure is retried, but a crash is."""
    engine.deploy({"id": "plain", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    run_id = engine.start("plain")
    _crash(engine, db_url, run_id, "w-dead")
    task = _task(engine, run_id)
    assert (task.state, task.attempt) == ("PENDING", 1)
    assert str(task.error).startswith("{'error': 'lease of w-dead expired at")
    [again] = engine.claim(["default"], "w-alive", 1)
    assert engine.complete(again, "done").finished == "SUCCEEDED"
    history = engine.get_run(run_id).history
    assert [(h.kind, h.attempt, h.worker) for h in history] == [
        ("started", None, None), ("claimed", 0, "w-dead"), ("lease_expired", 0, "w-dead"),
        ("claimed", 1, "w-alive"), ("completed", 1, "w-alive")]
    assert history[2].detail["requeued"] is True and "w-dead" in history[2].detail["error"]


def test_expiries_do_not_consume_the_retry_policy(engine: Engine, db_url: str) -> None:
    engine.deploy({"id": "twice", "nodes": [{"id": "a", "type": "TASK", "task": "t",
                                             "retry": {"max_attempts": 2, "initial_backoff_s": 0}}]})
    run_id = engine.start("twice")
    _crash(engine, db_url, run_id, "w1")
    _crash(engine, db_url, run_id, "w2")
    [claim] = engine.claim(["default"], "w3", 1)
    engine.fail(claim, "boom")                             # handler failure 1 of 2: retried
    assert (_task(engine, run_id).state, _task(engine, run_id).attempt) == ("PENDING", 3)
    [claim] = engine.claim(["default"], "w3", 1)
    assert engine.fail(claim, "boom again").finished == "FAILED"
    run = engine.get_run(run_id)
    assert run.error == {"error": 'node "a" failed after 2 attempts: boom again'}


def test_past_max_lease_expiries_the_task_fails_naming_them_and_the_last_owner(engine: Engine,
                                                                              db_url: str) -> None:
    engine.deploy({"id": "capped", "nodes": [{"id": "a", "type": "TASK", "task": "t", "max_lease_expiries": 2}]})
    run_id = engine.start("capped")
    _crash(engine, db_url, run_id, "w1")
    _crash(engine, db_url, run_id, "w2")
    _crash(engine, db_url, run_id, "w3")
    run = engine.get_run(run_id)
    assert run.status == "FAILED" and run.tasks[0].state == "FAILED"
    error = run.error["error"]
    assert error.startswith('node "a" failed: lease expired 3 times (max_lease_expiries is 2); last owner w3, '
                            "whose lease expired at "), error
    expiries = [h for h in run.history if h.kind == "lease_expired"]
    assert [(h.worker, h.detail["requeued"]) for h in expiries] == [("w1", True), ("w2", True), ("w3", False)]
    assert expiries[-1].detail["finished"] == "FAILED"
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT attempt, lease_expiries FROM task_instances WHERE run_id = %s",
                           (run_id,)).fetchone()
    assert row == (2, 2)


def test_a_claim_whose_acknowledgement_never_came_ends_in_a_requeue_not_a_failure(engine: Engine,
                                                                                  db_url: str) -> None:
    """A worker that claimed and never heard back (and never retried): its task runs
    nowhere; the lease lapses and the task is re-queued, under the default policy."""
    engine.deploy({"id": "plain", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    run_id = engine.start("plain")
    _crash(engine, db_url, run_id, "lost-claim")
    assert _task(engine, run_id).state == "PENDING"
    assert engine.get_run(run_id).status == "RUNNING"
