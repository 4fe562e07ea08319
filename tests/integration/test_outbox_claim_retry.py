"""A claim retried while its first attempt is still executing or committing on the
server (its client gave up on the connection) waits for that attempt, then returns the
tasks it took: none is left RUNNING under a lease its worker never learnt of. A first
attempt that reaches the server only after its retry committed finds the claim fenced
off and takes nothing.

The first attempt is the claim's statement run by hand on a connection of its own,
with claim ID ``C``, its transaction left open (a COMMIT held up by fsync or a
synchronous standby); the retry is the engine's own claim of the same request, run in
a thread as ``db_retry`` runs it after the first attempt raised."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.core.model import RunStatus
from composer_ops.engine.requests import Request
from composer_ops.repo import outbox
from composer_ops.repo.rows import Claim
from composer_ops.testing.processes import wait_for
from tests.integration.helpers import claim_ask


@pytest.fixture
def engine(engine: Engine) -> Engine:
    engine.deploy({"id": "once", "nodes": [{"id": "a", "type": "TASK", "task": "t", "lease_s": 1,
                                            "max_lease_expiries": 0}]})
    return engine


class Retry:
    """``engine``'s claim of request ``claim_id`` as its second attempt, in a thread."""

    def __init__(self, engine: Engine, claim_id: str) -> None:
        self.result: list[Claim] | None = None
        self.error: BaseException | None = None
        request = Request(tries=1)      # attempt 1 was the one run by hand

        def run() -> None:
            try:
                self.result = engine._claim(claim_ask(["default"], "w1", 1, ["t"], claim_id), request)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()


def _waiting_on_an_advisory_lock(db_url: str) -> Callable[[], bool]:
    def check() -> bool:
        with psycopg.connect(db_url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()
        return bool(row and row[0])
    return check


@pytest.fixture
def first(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(db_url) as conn:      # not autocommit: the claim's transaction stays open
        yield conn


def test_a_retry_waits_for_its_first_attempt_and_returns_what_it_took(
        engine: Engine, db_url: str, first: psycopg.Connection[Any]) -> None:
    run_id = engine.start("once")
    taken = outbox.claim(first, ["default"], "w1", 1, task_names=["t"], claim_id="claim-C")
    assert [c.run_id for c in taken] == [run_id]
    retry = Retry(engine, "claim-C")
    wait_for(lambda: retry.done() or _waiting_on_an_advisory_lock(db_url)(), timeout=30,
             what="the retry to return or to wait for the first attempt")
    assert not retry.done(), f"the retry returned {retry.result!r} while its first attempt was still open"
    first.commit()
    retry.thread.join(30)
    assert retry.error is None and retry.result is not None
    assert [(c.run_id, c.node_id, c.attempt, c.lease_owner) for c in retry.result] == [(run_id, "a", 0, "w1")]


def test_a_retry_after_its_first_attempt_rolled_back_claims(engine: Engine, db_url: str,
                                                            first: psycopg.Connection[Any]) -> None:
    run_id = engine.start("once")
    assert len(outbox.claim(first, ["default"], "w1", 1, task_names=["t"], claim_id="claim-C")) == 1
    retry = Retry(engine, "claim-C")
    wait_for(lambda: retry.done() or _waiting_on_an_advisory_lock(db_url)(), timeout=30,
             what="the retry to return or to wait for the first attempt")
    assert not retry.done()
    first.rollback()                   # the server killed the first attempt before its COMMIT
    retry.thread.join(30)
    assert retry.error is None and retry.result is not None
    assert [(c.run_id, c.attempt) for c in retry.result] == [(run_id, 0)]
    assert [h.kind for h in engine.get_run(run_id).history] == ["started", "claimed"]


def test_with_no_lease_expiry_allowed_the_run_is_not_failed_by_a_claim_its_worker_never_received(
        engine: Engine, db_url: str, first: psycopg.Connection[Any]) -> None:
    """``max_lease_expiries: 0``: the first expiry fails the task. The task the first
    attempt took reaches the worker through the retry, which runs it; no lease lapses."""
    run_id = engine.start("once")
    assert len(outbox.claim(first, ["default"], "w1", 1, task_names=["t"], claim_id="claim-C")) == 1
    retry = Retry(engine, "claim-C")
    wait_for(lambda: retry.done() or _waiting_on_an_advisory_lock(db_url)(), timeout=30,
             what="the retry to return or to wait for the first attempt")
    first.commit()
    retry.thread.join(30)
    assert retry.error is None and retry.result is not None
    for claim in retry.result:                             # the worker runs what it was given
        engine.complete(claim, {"ran": True})
    coordinator = engine.coordinator()

    def settled() -> bool:
        coordinator.run_once()
        return engine.get_run(run_id).status != RunStatus.RUNNING

    wait_for(settled, timeout=30, what="the run to finish, or its lease to lapse and be swept")
    run = engine.get_run(run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.status, [t.error for t in run.tasks])
    assert run.tasks[0].output == {"ran": True}


def test_a_first_attempt_that_reaches_the_server_after_its_retry_committed_claims_nothing(
        engine: Engine, db_url: str, first: psycopg.Connection[Any]) -> None:
    """The first attempt's statement was held in flight (its client gave up before the
    server saw it) while the retry looked, claimed and committed; another task became
    ready since. The late statement must not lease that task to a worker that was told
    nothing: it claims nothing, and the task stays for the next claim."""
    run_id = engine.start("once")
    retry = Retry(engine, "claim-C")
    retry.thread.join(30)
    assert retry.error is None and retry.result is not None
    assert [c.run_id for c in retry.result] == [run_id]
    later = engine.start("once")
    late = outbox.claim(first, ["default"], "w1", 1, task_names=["t"], claim_id="claim-C")
    first.commit()
    assert late == [], f"the late first attempt claimed {late}"
    assert engine.get_run(later).tasks[0].state == "PENDING"
    assert [c.run_id for c in engine.claim(["default"], "w2", 1, ["t"])] == [later]
