"""The worker's claim loop under a burst of starts: it never asks for room it does not
have, and failing claims back off instead of spinning.

A worker of two slots holds a long task in one; a claim that gets more than it asked
for (two tasks for one free slot) leaves more attempts in flight than slots. The loop
must then wait for room, not claim for a negative room (which the server refused with
"LIMIT must not be negative", and the loop retried at once, about 800 times a second,
for as long as the surplus ran)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from composer_ops import Engine, TaskContext, Worker
from composer_ops.errors import Invalid, Unavailable
from composer_ops.testing.processes import wait_for


class Burst:
    """A Worker of two slots in a thread, with a ``slow`` handler that holds its slot
    until ``release`` and a ``quick`` one; ``claims`` records each claim's limit, room
    and how many tasks it got."""

    def __init__(self, engine: Engine) -> None:
        engine.deploy({"id": "slow", "nodes": [{"id": "a", "type": "TASK", "task": "slow", "lease_s": 60}]})
        engine.deploy({"id": "quick", "nodes": [{"id": "a", "type": "TASK", "task": "quick", "lease_s": 60}]})
        self.engine = engine
        self.release = threading.Event()
        self.slow_started: list[str] = []
        self.quick_done: list[str] = []
        self.claims: list[tuple[int, int | None, int]] = []
        self.worker = Worker(engine, concurrency=2, poll_interval=0.2)

        @self.worker.handler("slow")
        def slow(input: Any, ctx: TaskContext) -> None:
            self.slow_started.append(ctx.run_id)
            self.release.wait(120)

        @self.worker.handler("quick")
        def quick(input: Any, ctx: TaskContext) -> None:
            self.quick_done.append(ctx.run_id)

        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def start_many(self, workflow: str, n: int, threads: int = 4) -> None:
        def part() -> None:
            for _ in range(n // threads):
                self.engine.start(workflow)

        starters = [threading.Thread(target=part) for _ in range(threads)]
        for t in starters:
            t.start()
        for t in starters:
            t.join(120)


@pytest.fixture
def burst(engine: Engine) -> Iterator[Burst]:
    b = Burst(engine)
    b.thread.start()
    try:
        yield b
    finally:
        b.release.set()
        b.worker.stop()
        b.thread.join(30)


def _failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("claim failed")]


def test_more_attempts_than_slots_wait_for_room_through_a_burst(
        burst: Burst, engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="composer_ops.engine.worker")
    real = engine.claim
    surplus = threading.Event()          # a claim got more than it asked for
    queued = threading.Event()           # both slow tasks are in the outbox

    def claim(queues: Any, owner: str, limit: int, *args: Any, **kwargs: Any) -> Any:
        ask = limit
        if limit >= 1 and not surplus.is_set() and burst.slow_started:
            queued.wait(60)
            ask = limit + 1
        got = real(queues, owner, ask, *args, **kwargs)
        if len(got) > limit:
            surplus.set()
        burst.claims.append((limit, kwargs.get("room"), len(got)))
        return got

    monkeypatch.setattr(engine, "claim", claim)
    engine.start("slow")
    wait_for(lambda: burst.slow_started, timeout=30, what="the first slow task to hold a slot")
    burst.start_many("slow", 2, threads=2)        # one free slot, two slow tasks claimed for it
    queued.set()
    wait_for(lambda: surplus.is_set() and burst.worker._free_slots() < 0, timeout=30,
             what="more attempts in flight than slots")
    burst.start_many("quick", 400)                # the burst, while the surplus lasts
    burst.release.set()
    wait_for(lambda: len(burst.quick_done) == 400, timeout=120, what="every quick task to run")
    assert surplus.is_set()
    assert all(limit >= 1 and (room is None or room >= 1) for limit, room, _ in burst.claims), burst.claims
    assert _failures(caplog) == []


def test_a_claim_for_no_room_is_refused_before_any_round_trip(engine: Engine) -> None:
    for limit, room in ((0, None), (-1, None), (1, 0), (True, None)):
        with pytest.raises(Invalid, match="at least 1"):
            engine.claim(["default"], "w", limit, room=room)


def test_failing_claims_back_off(burst: Burst, engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
    """While every claim fails, each failure is followed by a pause chosen by
    ``claim_backoff`` from the failures in a row (doubling, jittered, capped); the first
    claim that succeeds resets the count."""
    caplog.set_level(logging.WARNING, logger="composer_ops.engine.worker")
    pauses: list[int] = []
    real_backoff = burst.worker.claim_backoff
    down = threading.Event()
    down.set()
    real = engine.claim

    def claim(*args: Any, **kwargs: Any) -> Any:
        if down.is_set():
            raise Unavailable("the database is unreachable (test)")
        return real(*args, **kwargs)

    def backoff(failures: int) -> float:
        pauses.append(failures)
        if len(pauses) >= 6:
            down.clear()
        return min(real_backoff(failures), 0.05)

    monkeypatch.setattr(burst.worker, "claim_backoff", backoff)
    monkeypatch.setattr(engine, "claim", claim)
    burst.start_many("quick", 40)
    wait_for(lambda: len(burst.quick_done) == 40, timeout=60, what="the quick tasks to run once claims succeed")
    assert pauses[:6] == [0, 1, 2, 3, 4, 5]
    assert len(_failures(caplog)) == len(pauses)
    assert "6 in a row" in _failures(caplog)[5]
    assert 0 <= real_backoff(0) <= 0.05 and 0 <= real_backoff(50) <= 1.0
