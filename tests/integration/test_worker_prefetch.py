"""A worker that claims ahead (``prefetch``): its claims take tasks beyond its free
slots while its handlers are short, holds them for the next slot, extends their
leases while they wait, and stops claiming ahead as soon as a handler runs long.

Each test runs a real Worker against the database; what it checks is read from the
database (runs, history) and from the worker's own count of attempts in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, TaskContext, Worker
from composer_ops.engine.worker import SHORT_HANDLER_S, Result
from composer_ops.errors import Invalid
from composer_ops.testing.processes import wait_for


def _deploy(engine: Engine, workflow: str, task: str, lease_s: float = 60) -> None:
    engine.deploy({"id": workflow, "nodes": [{"id": "a", "type": "TASK", "task": task, "lease_s": lease_s}]})


def _running(worker: Worker) -> Callable[[], None]:
    """Starts ``worker.run`` in a thread; the returned function stops and joins it."""
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()

    def stop() -> None:
        worker.stop()
        thread.join(60)
        assert not thread.is_alive(), "the worker did not stop"
    return stop


def _run_until_reported(worker: Worker, results: list[Result], count: int, timeout: float) -> None:
    """Runs ``worker`` until ``count`` attempts are reported in ``results`` (its
    ``on_result``), then stops it."""
    stop = _running(worker)
    try:
        wait_for(lambda: len(results) >= count, timeout=timeout, what="every task reported")
    finally:
        stop()


def _history(db_url: str, runs: list[str]) -> dict[str, list[str]]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT run_id, kind FROM run_history WHERE run_id = ANY(%s) ORDER BY seq",
                            (runs,)).fetchall()
    out: dict[str, list[str]] = {r: [] for r in runs}
    for run_id, kind in rows:
        out[run_id].append(kind)
    return out


def _statuses(db_url: str, runs: list[str]) -> set[str]:
    with psycopg.connect(db_url) as conn:
        return {r[0] for r in conn.execute("SELECT DISTINCT status FROM workflow_runs WHERE id = ANY(%s)",
                                           (runs,)).fetchall()}


def test_a_worker_claims_ahead_over_a_backlog_and_runs_every_task_once(db_url: str, engine: Engine) -> None:
    _deploy(engine, "quick", "quick")
    runs = [engine.start("quick") for _ in range(150)]
    in_flight: list[int] = []
    results: list[Result] = []
    with Engine.connect(db_url, pool_size=4) as w_engine:
        worker = Worker(w_engine, concurrency=2, prefetch=4, poll_interval=0.2, on_result=results.append)

        @worker.handler("quick")
        def quick(input: Any, ctx: TaskContext) -> None:
            in_flight.append(worker._inflight)
            time.sleep(0.002)

        _run_until_reported(worker, results, len(runs), timeout=120)
    assert sorted(r.status for r in results) == ["completed"] * len(runs)
    assert _statuses(db_url, runs) == {"SUCCEEDED"}
    # Each task claimed once and completed once; nothing given up or expired.
    assert {tuple(kinds) for kinds in _history(db_url, runs).values()} == {("started", "claimed", "completed")}
    # It held tasks beyond its slots, never more than prefetch beyond them.
    assert max(in_flight) > worker.concurrency, in_flight
    assert max(in_flight) <= worker.concurrency + worker.prefetch, in_flight


def test_held_tasks_keep_their_leases_and_start_in_the_order_claimed(db_url: str, engine: Engine) -> None:
    """One slot, twelve held beyond it, a lease of two seconds and handlers of 0.25: a
    held task waits up to 3 s, past the lease its claim gave it, so it runs only if the
    worker's heartbeats extended its lease while it waited. And with one slot the tasks
    start in the order they were handed out: a report never puts the task it claimed
    before those held."""
    _deploy(engine, "steady", "steady", lease_s=2)
    runs = [engine.start("steady") for _ in range(48)]
    held: list[str] = []
    started: list[str] = []
    past_lease: list[str] = []
    results: list[Result] = []
    with Engine.connect(db_url, pool_size=4) as w_engine:
        worker = Worker(w_engine, concurrency=1, prefetch=12, poll_interval=0.2, on_result=results.append)
        hold = worker._hold

        def holding(claim: Any, claimed_at: float) -> TaskContext:
            held.append(claim.task_id)
            return hold(claim, claimed_at)

        worker._hold = holding  # type: ignore[method-assign]

        @worker.handler("steady")
        def steady(input: Any, ctx: TaskContext) -> None:
            started.append(ctx.task_id)
            if datetime.now(UTC) > ctx._claim.lease_expires_at:
                past_lease.append(ctx.task_id)
            time.sleep(0.25)

        _run_until_reported(worker, results, len(runs), timeout=180)
    assert [r.status for r in results] == ["completed"] * len(runs), [r.detail for r in results]
    assert past_lease, "no held task waited past the lease its claim gave it"
    assert started == held
    assert {tuple(kinds) for kinds in _history(db_url, runs).values()} == {("started", "claimed", "completed")}


def test_a_long_handler_stops_the_claims_ahead(db_url: str, engine: Engine) -> None:
    """Quick tasks warm the worker up; then a handler runs long in one of its two slots
    while quick ones keep coming: once it has run past SHORT_HANDLER_S, the worker holds
    nothing beyond its slots, so no task waits behind it."""
    _deploy(engine, "quick", "quick")
    _deploy(engine, "slow", "slow")
    release = threading.Event()
    slow_started: list[float] = []
    samples: list[tuple[float, int]] = []
    results: list[Result] = []
    with Engine.connect(db_url, pool_size=4) as w_engine:
        worker = Worker(w_engine, concurrency=2, prefetch=4, poll_interval=0.2, on_result=results.append)

        @worker.handler("quick")
        def quick(input: Any, ctx: TaskContext) -> None:
            samples.append((time.monotonic(), worker._inflight))
            time.sleep(0.005)

        @worker.handler("slow")
        def slow(input: Any, ctx: TaskContext) -> None:
            slow_started.append(time.monotonic())
            release.wait(60)

        stop = _running(worker)
        feeding = threading.Event()

        def feed() -> None:
            while not feeding.is_set():
                engine.start("quick")
                time.sleep(0.003)

        try:
            for _ in range(40):
                engine.start("quick")
            wait_for(lambda: len(results) >= 40, timeout=60, what="the warm-up")
            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
            wait_for(lambda: any(n > worker.concurrency for _, n in samples), timeout=60,
                     what="a task held beyond the slots")
            engine.start("slow")
            wait_for(lambda: bool(slow_started), timeout=60, what="the slow handler")
            long_since = slow_started[0] + SHORT_HANDLER_S
            # Held tasks claimed before it ran long drain through the other slot.
            wait_for(lambda: any(at > long_since + 1.0 for at, _ in samples), timeout=60,
                     what="quick tasks a second after the slow one ran long")
            settled = long_since + 1.0
            wait_for(lambda: sum(at > settled for at, _ in samples) >= 30, timeout=60,
                     what="quick tasks beside the slow one")
        finally:
            feeding.set()
            release.set()
            stop()
    beside = [n for at, n in samples if at > settled]
    assert beside and max(beside) <= worker.concurrency, beside


def test_prefetch_is_a_whole_number_from_zero(engine: Engine) -> None:
    for bad in (-1, True, 1.5, "2", 1001):
        with pytest.raises(Invalid, match="prefetch must be a whole number"):
            Worker(engine, prefetch=bad)  # type: ignore[arg-type]
    worker = Worker(engine, prefetch=0)
    worker.handler("x")(lambda input, ctx: None)
    worker.prefetch = -3         # set after construction, as the CLI does: refused when it runs
    with pytest.raises(Invalid, match="prefetch must be a whole number"):
        worker.run()


def _warm_then_hold(db_url: str, engine: Engine, worker: Worker, block: threading.Event,
                    blocked: threading.Event, release: threading.Event, ran: list[str]) -> None:
    """Register on ``worker`` (one slot) a handler that, once the worker holds tasks
    beyond its slot, blocks its slot (``blocked``) until ``release``: the held tasks
    then wait for the slot."""

    @worker.handler("quick")
    def quick(input: Any, ctx: TaskContext) -> None:
        ran.append(ctx.run_id)
        if not block.is_set() and worker._inflight > worker.concurrency:
            block.set()
            blocked.set()
            release.wait(60)


def test_tasks_held_when_the_worker_stops_are_run_before_it_returns(db_url: str, engine: Engine) -> None:
    _deploy(engine, "quick", "quick")
    runs = [engine.start("quick") for _ in range(60)]
    block, blocked, release = threading.Event(), threading.Event(), threading.Event()
    ran: list[str] = []
    with Engine.connect(db_url, pool_size=4) as w_engine:
        worker = Worker(w_engine, concurrency=1, prefetch=4, poll_interval=0.2)
        _warm_then_hold(db_url, engine, worker, block, blocked, release, ran)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        assert blocked.wait(60), "the worker never held a task beyond its slot"
        with worker._claim_lock:            # hand-outs count their tasks under it
            held = worker._inflight - 1
        worker.stop()
        release.set()
        thread.join(60)
        assert not thread.is_alive()
    assert held >= 1
    history = _history(db_url, runs)
    claimed = [r for r, kinds in history.items() if "claimed" in kinds]
    # Everything it claimed (the held tasks too) ran and completed; nothing is left leased.
    assert all(history[r] == ["started", "claimed", "completed"] for r in claimed), history
    assert sorted(ran) == sorted(claimed)


def test_tasks_held_when_the_shutdown_gives_up_are_never_started(db_url: str, engine: Engine) -> None:
    _deploy(engine, "quick", "quick")
    runs = [engine.start("quick") for _ in range(60)]
    block, blocked, release = threading.Event(), threading.Event(), threading.Event()
    ran: list[str] = []
    raised: list[BaseException] = []
    with Engine.connect(db_url, pool_size=4) as w_engine:
        worker = Worker(w_engine, concurrency=1, prefetch=4, poll_interval=0.2, shutdown_timeout=0.5)
        _warm_then_hold(db_url, engine, worker, block, blocked, release, ran)

        def run() -> None:
            try:
                worker.run()
            except BaseException as exc:
                raised.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert blocked.wait(60), "the worker never held a task beyond its slot"
        with worker._claim_lock:            # hand-outs count their tasks under it
            held = worker._inflight - 1
        worker.stop()
        thread.join(30)
        assert not thread.is_alive()
        release.set()               # the blocked handler ends after the worker gave up on it
        blocked_run = ran[-1]
        wait_for(lambda: "completed" in _history(db_url, [blocked_run])[blocked_run], timeout=60,
                 what="the blocked handler's result")
        # Its slot goes on through the queue: every held task taken, none started.
        wait_for(lambda: worker._inflight == 0, timeout=60, what="the held tasks dequeued")
    assert held >= 1 and len(raised) == 1, raised
    assert f"1 handler(s) still running and {held} task(s) held for a slot" in str(raised[0]), raised
    history = _history(db_url, runs)
    never = [r for r, kinds in history.items() if kinds == ["started", "claimed", "lease_lost"]]
    assert len(never) == held, history
    assert not set(never) & set(ran), "a task abandoned while held was started"
    with psycopg.connect(db_url) as conn:
        details = [r[0] for r in conn.execute(
            "SELECT detail->>'reason' FROM run_history WHERE kind = 'lease_lost' AND run_id = ANY(%s)",
            (never,)).fetchall()]
    assert len(details) == held and all("not started (held for a slot)" in (d or "") and "its lease was ended"
                                        in (d or "") for d in details), details
    # Their leases ended at shutdown (not one lease later), for the sweeper to re-queue at once.
    with psycopg.connect(db_url) as conn:
        ended = conn.execute("SELECT bool_and(lease_expires_at <= now()), count(*) FROM task_instances "
                             "WHERE run_id = ANY(%s) AND state = 'RUNNING'", (never,)).fetchone()
    assert ended == (True, held), ended
