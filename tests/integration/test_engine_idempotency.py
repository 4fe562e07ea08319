"""Every write that may be retried, retried after its COMMIT acknowledgement was lost.

``lose_ack`` lets the server commit a transaction, then kills the session before the
client has moved on (``pg_terminate_backend`` of its own backend): the driver raises
the connection error a lost acknowledgement raises, and the engine's retry runs the
transaction again. Each test checks that the retry recognised its own commit: the
original outcome comes back, and nothing was applied twice.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.pq import Trace

from composer_ops import Conflict, Engine, Invalid
from composer_ops.core.model import RunStatus
from composer_ops.db import make_pool
from composer_ops.engine.coordinator import PassStats
from composer_ops.engine.shell import Outcome
from composer_ops.repo import history
from tests.integration.helpers import LoseAck, now_utc, uuid7_at


@pytest.fixture
def engine(engine: Engine) -> Engine:
    engine.deploy({"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    engine.deploy({"id": "retried", "nodes": [{"id": "a", "type": "TASK", "task": "t",
                                                   "retry": {"max_attempts": 3, "initial_backoff_s": 0}}]})
    engine.deploy({"id": "two_waiters", "nodes": [
        {"id": "w1", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
        {"id": "w2", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
        {"id": "after", "type": "TASK", "task": "t", "depends_on": ["w1", "w2"]}]})
    engine.deploy({"id": "one_waiter", "nodes": [{"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go"}]})
    return engine


def lost_ack(engine: Engine, monkeypatch: pytest.MonkeyPatch, call: Callable[[], Any], skip: int = 0) -> Any:
    """``call()`` with the acknowledgement of its first commit (after ``skip``) lost."""
    lose = LoseAck(engine, skip=skip)
    monkeypatch.setattr(engine.pool, "connection", lose)
    try:
        return call()
    finally:
        monkeypatch.undo()
        assert lose.fired == 1, "the fault was not injected"


def states(engine: Engine, run_id: str) -> dict[str, tuple[str, int]]:
    return {t.node_id: (t.state, t.attempt) for t in engine.get_run(run_id).tasks}


def kinds(engine: Engine, run_id: str) -> list[str]:
    return [h.kind for h in engine.get_run(run_id).history]


def test_a_signal_whose_acknowledgement_was_lost_resolves_one_node(engine: Engine,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = engine.start("two_waiters")
    outcome = lost_ack(engine, monkeypatch, lambda: engine.signal(run_id, "go", {"n": 1}))
    assert sorted(states(engine, run_id).values()) == [("COMPLETED", 0), ("WAITING", 0)]
    assert outcome.applied and outcome.duplicate and outcome.finished is None
    assert kinds(engine, run_id) == ["started", "signal"]
    engine.signal(run_id, "go", {"n": 2})                 # the second waiter still gets its own signal
    assert states(engine, run_id)["after"] == ("PENDING", 0)


def test_a_replayed_cancel_returns_its_outcome(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = engine.start("one")
    outcome = lost_ack(engine, monkeypatch, lambda: engine.cancel(run_id, reason="stop"))
    assert outcome == Outcome(run_id=run_id, finished=RunStatus.CANCELLED, duplicate=True)
    assert engine.get_run(run_id).status == "CANCELLED"
    with pytest.raises(Conflict, match="is CANCELLED"):   # a new cancel is still refused
        engine.cancel(run_id)


def test_a_replayed_signal_that_finished_the_run_returns_its_outcome(engine: Engine,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = engine.start("one_waiter")
    outcome = lost_ack(engine, monkeypatch, lambda: engine.signal(run_id, "go", "done"))
    assert outcome == Outcome(run_id=run_id, finished=RunStatus.SUCCEEDED, duplicate=True)
    assert engine.get_run(run_id).output == {"w": "done"}


def test_a_replayed_completion_is_applied_not_stale(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = engine.start("one")
    [claim] = engine.claim(["default"], "w1", 1)
    outcome = lost_ack(engine, monkeypatch, lambda: engine.complete(claim, {"ok": True}))
    assert outcome.applied and outcome.finished == RunStatus.SUCCEEDED
    assert engine.get_run(run_id).output == {"a": {"ok": True}}
    assert kinds(engine, run_id) == ["started", "claimed", "completed"]


def test_a_replayed_failure_is_applied_once(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = engine.start("retried")
    [claim] = engine.claim(["default"], "w1", 1)
    outcome = lost_ack(engine, monkeypatch, lambda: engine.fail(claim, "boom"))
    assert outcome.applied and outcome.finished is None
    assert states(engine, run_id) == {"a": ("PENDING", 1)}      # re-queued once, not twice
    history = engine.get_run(run_id).history
    assert [h.kind for h in history] == ["started", "claimed", "failed"]
    assert history[-1].detail == {"error": "boom", "requeued": True, "retryable": True,
                                  "available_at": history[-1].detail["available_at"]}


def test_a_claim_whose_acknowledgement_was_lost_returns_the_tasks_it_took(engine: Engine,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = engine.start("one")
    claims = lost_ack(engine, monkeypatch, lambda: engine.claim(["default"], "w1", 5, task_names=["t"]))
    assert [(c.run_id, c.node_id, c.attempt, c.lease_owner, c.task_name, c.queue) for c in claims] == [
        (run_id, "a", 0, "w1", "t", "default")]
    assert kinds(engine, run_id) == ["started", "claimed"]
    assert engine.complete(claims[0], 1).finished == RunStatus.SUCCEEDED


def test_a_start_with_a_client_run_id_whose_acknowledgement_was_lost_returns_the_run(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = uuid7_at(now_utc())
    assert lost_ack(engine, monkeypatch, lambda: engine.start("one", run_id=run_id)) == run_id
    assert states(engine, run_id) == {"a": ("PENDING", 0)}
    with pytest.raises(Conflict, match="already exists"):       # a second start of that ID is still refused
        engine.start("one", run_id=run_id)


def test_a_start_with_a_minted_run_id_whose_acknowledgement_was_lost_starts_one_run(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = lost_ack(engine, monkeypatch, lambda: engine.start("one", input={"token": 7}))
    with engine.pool.connection() as conn:
        rows = conn.execute("SELECT id FROM workflow_runs WHERE input_json->>'token' = '7'").fetchall()
    assert rows == [(run_id,)]


def test_a_heartbeat_retried_after_a_lost_acknowledgement_still_holds_the_lease(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    engine.start("one")
    [claim] = engine.claim(["default"], "w1", 1)
    extended = lost_ack(engine, monkeypatch, lambda: engine.heartbeat(claim))
    assert extended is not None and extended > claim.lease_expires_at


def test_a_lease_expiry_whose_acknowledgement_was_lost_is_counted_once(engine: Engine, db_url: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's own events go through the same retry: the sweep's retried
    event returns its outcome rather than finding its own re-queue stale."""
    run_id = engine.start("one")
    engine.claim(["default"], "dead", 1)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE task_instances SET lease_expires_at = now() - interval '1 s' WHERE run_id = %s",
                     (run_id,))
    coordinator, stats = engine.coordinator(), PassStats()
    lost_ack(engine, monkeypatch, lambda: coordinator._leases(stats), skip=1)   # skip the sweep's read
    assert (stats.leases_expired, stats.stale, stats.errors) == (1, 0, [])
    assert states(engine, run_id) == {"a": ("PENDING", 1)}


def test_a_delete_whose_acknowledgement_was_lost_returns_what_it_did(engine: Engine,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry finds the run deleted by its own lost attempt: it reports that delete
    (not an earlier one), with the webhook delivery it gave up, and records it once."""
    engine.deploy({"id": "hooked", "webhook_url": "http://127.0.0.1:9/never",
                   "nodes": [{"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go"}]})
    run_id = engine.start("hooked")
    engine.signal(run_id, "go")
    done = lost_ack(engine, monkeypatch, lambda: engine.delete_run(run_id))
    assert (done.already, done.status, done.webhooks_given_up) == (False, "SUCCEEDED", 1)
    with engine.pool.connection() as conn:
        assert [h.kind for h in history.run_history(conn, run_id)].count("deleted") == 1
    again = engine.delete_run(run_id)                 # a second call is a second delete: already done
    assert (again.already, again.deleted_at, again.webhooks_given_up) == (True, done.deleted_at, 0)


# -- the caller's idempotency key --------------------------------------------------------


def test_two_signals_with_one_key_resolve_at_most_one_node(engine: Engine) -> None:
    run_id = engine.start("two_waiters")
    first = engine.signal(run_id, "go", {"n": 1}, key="delivery-42")
    again = engine.signal(run_id, "go", {"n": 2}, key="delivery-42")
    assert first.applied and not first.duplicate
    assert again.duplicate and again.finished is None
    assert sorted(states(engine, run_id).values()) == [("COMPLETED", 0), ("WAITING", 0)]
    other = engine.signal(run_id, "go", {"n": 3}, key="delivery-43")
    assert not other.duplicate and states(engine, run_id)["after"] == ("PENDING", 0)
    signals = [h.detail for h in engine.get_run(run_id).history if h.kind == "signal"]
    assert [d["key"] for d in signals] == ["delivery-42", "delivery-43"]


def test_a_keyed_signal_buffered_then_repeated_is_not_buffered_again(engine: Engine) -> None:
    engine.deploy({"id": "late_waiter", "nodes": [
        {"id": "a", "type": "TASK", "task": "t"},
        {"id": "w1", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["a"]},
        {"id": "w2", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["a"]}]})
    run_id = engine.start("late_waiter")
    engine.signal(run_id, "go", 1, key="k")
    assert engine.signal(run_id, "go", 1, key="k").duplicate
    with engine.pool.connection() as conn:
        row = conn.execute("SELECT count(*) FROM workflow_events WHERE run_id = %s", (run_id,)).fetchone()
    assert row == (1,)


def test_a_key_repeated_after_the_run_finished_returns_the_first_outcome(engine: Engine) -> None:
    run_id = engine.start("one_waiter")
    assert engine.signal(run_id, "go", key="k").finished == RunStatus.SUCCEEDED
    again = engine.signal(run_id, "go", key="k")
    assert again.duplicate and again.finished == RunStatus.SUCCEEDED
    with pytest.raises(Conflict, match="accepts no signals"):    # without the key: a new signal, refused
        engine.signal(run_id, "go")


def test_a_key_used_for_another_signal_name_is_a_conflict(engine: Engine) -> None:
    engine.deploy({"id": "two_names", "nodes": [{"id": "x", "type": "WAIT_FOR_SIGNAL", "signal": "x"},
                                                {"id": "y", "type": "WAIT_FOR_SIGNAL", "signal": "y"}]})
    run_id = engine.start("two_names")
    engine.signal(run_id, "x", key="k")
    with pytest.raises(Conflict, match="this signal key was used for signal 'x', not 'y'"):
        engine.signal(run_id, "y", key="k")


@pytest.mark.parametrize("key", ["", "   ", "x" * 201, "a\nb", "nul\x00"])
def test_bad_keys_are_refused_before_anything_is_written(engine: Engine, key: str) -> None:
    run_id = engine.start("one_waiter")
    with pytest.raises(Invalid, match="signal key"):
        engine.signal(run_id, "go", key=key)
    assert kinds(engine, run_id) == ["started"]


def test_concurrent_calls_with_one_key_resolve_one_node(engine: Engine) -> None:
    run_id = engine.start("two_waiters")
    outcomes: list[Outcome] = []
    barrier = threading.Barrier(3)

    def send() -> None:
        barrier.wait()
        outcomes.append(engine.signal(run_id, "go", key="same"))

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(o.duplicate for o in outcomes) == [False, True, True]
    assert sorted(states(engine, run_id).values()) == [("COMPLETED", 0), ("WAITING", 0)]


# -- what a first attempt costs ------------------------------------------------------------


def _traced(engine: Engine, path: Path, call: Callable[[], Any]) -> list[str]:
    """The frontend messages (with their SQL) ``call`` sent on the pool's one connection."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with engine.pool.connection() as conn:
            conn.pgconn.trace(fd)
            conn.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS)
        call()
        with engine.pool.connection() as conn:
            conn.pgconn.untrace()
    finally:
        os.close(fd)
    return [line for line in path.read_text(errors="replace").splitlines() if line.startswith("F\t")]


def test_only_a_retry_looks_for_its_request(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first attempt writes its history in the statements it runs anyway and reads
    nothing more (the wire shows no lookup); the lookup of the request's rows is made
    by a retry only, once."""
    engine = Engine(make_pool(db_url, min_size=1, max_size=1), db_url)
    try:
        engine.deploy({"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        first = _traced(engine, tmp_path / "start.trace", lambda: engine.start("one"))
        [claim] = engine.claim(["default"], "w1", 1)
        done = _traced(engine, tmp_path / "complete.trace", lambda: engine.complete(claim, None))
        sent = [m for m in first + done if "Parse" in m]
        assert sent and not [m for m in sent if "request = " in m], sent
        run_id = engine.start("one")
        lookups: list[str] = []
        real = history.of_request

        def counted(conn: Any, run: str, request: str) -> Any:
            lookups.append(request)
            return real(conn, run, request)

        monkeypatch.setattr(history, "of_request", counted)
        engine.cancel(run_id)
        assert lookups == []                              # a first attempt that succeeds: no lookup
        other = engine.start("one")
        lost_ack(engine, monkeypatch, lambda: engine.cancel(other))
        assert lookups == [lookups[0]] and len(lookups) == 1   # the retried cancel: one lookup
    finally:
        engine.close()
