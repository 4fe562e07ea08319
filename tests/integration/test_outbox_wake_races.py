"""The races of the wake-up handshake (sql/R__dispatch.sql), each forced.

A waiter registers its free slots; a dispatch hands it wake-ups. What can go wrong: a
waiter killed (its row outlives it), a waiter woken whose claim finds its task taken by
another, two dispatches racing for one waiter. Wake-ups are an optimisation and the poll
the safety net: none of these leaves a task undispatched past an idle worker's poll.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, Worker
from composer_ops.db.connect import connect
from composer_ops.repo import outbox, workers
from composer_ops.testing.processes import TERMINAL, wait_for
from tests.integration.test_outbox_wake_one import SENTINEL, Wakes, wakes  # noqa: F401  (the fixture)

ONE = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "noop"}]}

#: A worker process that registers as idle (an empty claim with its wake channel and
#: room for 4), says so, and waits to be killed.
_WAITER = """
import sys, time
import psycopg
from composer_ops.repo import outbox
with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    assert outbox.claim(conn, ["default"], "dead", 4, task_names=["noop"], claim_id="dead-1",
                        wake=outbox.wake_channel("dead"), seen=0) == []
    print("ready", flush=True)
    time.sleep(3600)
"""


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(ONE)
        yield engine


@contextlib.contextmanager
def _serving(w_engine: Engine, worker_id: str, concurrency: int, *, poll: float = 3600.0,
             handler: Callable[[Any, Any], None] = lambda _input, _ctx: None) -> Iterator[Worker]:
    """A worker on ``w_engine`` (closed afterwards) running ``handler`` for task "noop" on
    a thread, stopped when the block ends."""
    worker = Worker(w_engine, concurrency=concurrency, poll_interval=poll, worker_id=worker_id)
    worker.handler("noop")(handler)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(60)
        w_engine.close()


def _finished(engine: Engine, run_id: str) -> bool:
    return engine.get_run(run_id).status in TERMINAL


def _room(engine: Engine, worker: str) -> int:
    with engine.pool.connection() as conn:
        row = conn.execute("SELECT slots - (promised - seen) FROM task_waiters WHERE worker = %s",
                           (worker,)).fetchone()
    return 0 if row is None else int(row[0])


def test_a_killed_waiters_task_is_claimed_by_an_idle_workers_poll(db_url: str, engine: Engine) -> None:
    """A waiter killed keeps its registration, and a dispatch may hand it the task: the
    live idle worker, never told, claims it at its next poll (2 s here)."""
    poll = 2.0
    with _serving(Engine.connect(db_url, pool_size=2), "live", 2, poll=poll):
        wait_for(lambda: _room(engine, "live") == 2, what="the live worker idle")
        with subprocess.Popen([sys.executable, "-c", _WAITER, db_url], stdout=subprocess.PIPE, text=True) as dead:
            try:
                assert dead.stdout is not None and dead.stdout.readline().strip() == "ready"
            finally:
                dead.kill()
                dead.wait(30)
        with psycopg.connect(db_url, autocommit=True) as listen:
            outbox.listen(listen, outbox.wake_channel("dead"))
            outbox.listen(listen, outbox.CHANNEL)
            listen.execute(f"LISTEN {SENTINEL}")
            with engine.pool.connection() as conn:   # as if it registered last: the live one polls meanwhile
                conn.execute("UPDATE task_waiters SET since = now() + interval '1 hour' WHERE worker = 'dead'")
            began = time.monotonic()
            run_id = engine.start("one")
            with engine.pool.connection() as conn:   # heard after everything the start's commit sent
                conn.execute(f"NOTIFY {SENTINEL}")
            told: list[tuple[str, str]] = []
            for n in listen.notifies(timeout=60):
                if n.channel == SENTINEL:
                    break
                told.append((n.channel, n.payload))
            else:
                raise AssertionError(f"the listener did not hear {SENTINEL} within 60 s (before it: {told})")
        assert told == [(outbox.wake_channel("dead"), "1")]
        wait_for(partial(_finished, engine, run_id), timeout=poll + 20, what=f"run {run_id} claimed by a poll")
        took = time.monotonic() - began
    assert took < poll + 20
    assert engine.get_run(run_id).tasks[0].state == "COMPLETED"


def test_a_woken_worker_whose_task_another_took_is_woken_again(db_url: str, engine: Engine) -> None:
    """A worker woken for a task whose claim finds it taken by another (the claim of a
    worker that polled) comes back empty and registers its whole room again: the next
    dispatch wakes it on its own channel, and it claims that task."""
    taken = threading.Event()
    go = threading.Event()
    w_engine = Engine.connect(db_url, pool_size=2)
    claim = w_engine.claim

    def held(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("seen"):          # a claim for wake-ups: waits until the task is taken
            taken.set()
            go.wait(30)
        return claim(*args, **kwargs)

    w_engine.claim = held  # type: ignore[method-assign]
    with _serving(w_engine, "woken", 2) as worker, _released(go):
        wait_for(lambda: _room(engine, "woken") == 2, what="the worker idle")
        first = engine.start("one")
        assert taken.wait(30), "the worker was not woken"
        with engine.pool.connection() as conn:
            assert len(outbox.claim(conn, ["default"], "other", 1, claim_id="other")) == 1
        go.set()
        wait_for(lambda: worker.claim_counts()["own"] == {"claims": 1, "empty": 1}, what="the empty claim")
        wait_for(lambda: _room(engine, "woken") == 2, what="the worker's room registered again")
        second = engine.start("one")
        wait_for(partial(_finished, engine, second), what=f"run {second}")
    assert engine.get_run(first).tasks[0].state == "RUNNING"      # the other holds it
    assert worker.claim_counts()["own"] == {"claims": 2, "empty": 1}


def test_two_dispatches_racing_for_one_waiter(db_url: str, wakes: Wakes) -> None:  # noqa: F811
    """The first dispatch holds the waiter's row until it commits; the second skips it,
    never waiting, and tells the waiter on its own channel with no wake-up handed (it
    claims all it has room for); the waiter is handed the first's task."""
    wakes.idle("a", room=2, seen=0)
    with psycopg.connect(db_url) as first, psycopg.connect(db_url, autocommit=True) as second:
        Wakes(first, wakes.listen, wakes.channels).dispatch()          # uncommitted: holds a's row
        racing = threading.Thread(target=Wakes(second, wakes.listen, wakes.channels).dispatch, daemon=True)
        racing.start()
        racing.join(30)
        assert not racing.is_alive(), "the second dispatch waited for the first"
        assert wakes.told() == [("a", "")]
        first.commit()
    assert wakes.told() == [("a", "1")]


def test_a_worker_whose_registration_is_held_is_told_and_claims(db_url: str, engine: Engine) -> None:
    """An idle worker's registration held by a transaction not yet committed (a claim
    or a dispatch of its own): a dispatch cannot hand it a wake-up, so it tells it on its
    own channel, and the worker claims the task while the row is still held (its claim
    skips writing its registration rather than wait)."""
    with _serving(Engine.connect(db_url, pool_size=2), "held", 1) as worker, \
            psycopg.connect(db_url, autocommit=True) as listen:
        outbox.listen(listen, outbox.CHANNEL)
        outbox.listen(listen, SENTINEL)
        wait_for(lambda: _room(engine, "held") == 1, what="the worker idle")
        with psycopg.connect(db_url) as holder:
            holder.execute("SELECT 1 FROM task_waiters WHERE worker = 'held' FOR UPDATE")
            run_id = engine.start("one")
            wait_for(partial(_finished, engine, run_id), what=f"run {run_id} claimed while the row is held")
        assert worker.claim_counts()["shared"] == {"claims": 1, "empty": 0}
        assert worker.claim_counts()["own"]["claims"] == 0
        with engine.pool.connection() as conn:       # heard after everything the start's commit sent
            conn.execute(f"NOTIFY {SENTINEL}")
        heard = []
        for n in listen.notifies(timeout=60):
            if n.channel == SENTINEL:
                break
            heard.append(n.payload)
        assert heard == [], "the shared channel was told"


def test_a_wake_up_handed_to_a_killed_busy_worker_is_claimed_at_a_poll(db_url: str, engine: Engine) -> None:
    """A dispatch with no room registered hands the task to a busy worker, here one that
    was killed while busy (its registration outlives it, the most recent). The live
    worker, busy when the task came and never told, registers its slot when it frees,
    and claims the task at its poll (2 s here)."""
    poll = 2.0
    go = threading.Event()

    def held(_input: Any, _ctx: Any) -> None:
        go.wait(30)

    with _serving(Engine.connect(db_url, pool_size=2), "live", 1, poll=poll, handler=held) as worker, \
            _released(go):
        wait_for(lambda: _room(engine, "live") == 1, what="the live worker idle")
        first = engine.start("one")
        wait_for(lambda: worker.claim_counts()["own"]["claims"] == 1, what="the live worker busy")
        with engine.pool.connection() as conn:
            conn.execute("INSERT INTO task_waiters (worker, channel, queues, task_names, slots, promised, seen) "
                         "VALUES ('dead', %s, '{default}', '{noop}', 0, 0, 0)", (outbox.wake_channel("dead"),))
        second = engine.start("one")
        wait_for(lambda: _promised(engine, "dead") == 1, what="the wake-up handed to the killed worker")
        go.set()
        wait_for(partial(_finished, engine, first), what=f"run {first}")
        wait_for(partial(_finished, engine, second), what=f"run {second} claimed at a poll")
    counts = worker.claim_counts()
    assert counts["room"]["claims"] >= 2, counts        # its first claim, and the poll's
    assert counts["shared"]["claims"] == 0, counts      # never told


def _promised(engine: Engine, worker: str) -> int:
    with engine.pool.connection() as conn:
        row = conn.execute("SELECT promised FROM task_waiters WHERE worker = %s", (worker,)).fetchone()
    return 0 if row is None else int(row[0])


def test_a_worker_that_fills_its_slots_claims_again_only_for_tasks_left(db_url: str, engine: Engine) -> None:
    """A worker of one slot, two tasks ready: its first claim fills the slot and leaves
    one task, so it hands the worker a wake-up, and the worker claims that task when the
    slot frees; that claim leaves nothing, so the worker registers its freed slot instead
    of claiming (a claim would come back empty), and the next dispatch wakes it."""
    first, second = engine.start("one"), engine.start("one")
    with _serving(Engine.connect(db_url, pool_size=2), "single", 1) as worker:
        for run_id in (first, second):
            wait_for(partial(_finished, engine, run_id), what=f"run {run_id}")
        wait_for(lambda: _room(engine, "single") == 1, what="the freed slot registered")
        assert worker.claim_counts() == {"own": {"claims": 1, "empty": 0}, "shared": {"claims": 0, "empty": 0},
                                         "room": {"claims": 1, "empty": 0}}
        third = engine.start("one")
        wait_for(partial(_finished, engine, third), what=f"run {third}")
    assert worker.claim_counts()["own"] == {"claims": 2, "empty": 0}


def test_a_backlog_is_drained_at_full_concurrency_without_the_poll(db_url: str, engine: Engine) -> None:
    """24 tasks ready before a worker of 4 slots starts, never a dispatch after: only the
    claims' own wake-ups drive it. Its handlers finish four at a time (a barrier), so
    several slots free between two claims while the worker holds one wake-up: the claim
    taking that one must hand it wake-ups for the ready rows its free slots can take, or
    the worker waits for its poll (an hour here) with a backlog and free slots (0.04x the
    drain rate of 5f2f967 in bench.ab before the fix)."""
    runs = [engine.start("one") for _ in range(24)]
    together = threading.Barrier(4)

    def noop(_input: Any, _ctx: Any) -> None:
        together.wait(timeout=300)

    with _serving(Engine.connect(db_url, pool_size=6), "drainer", 4, handler=noop):
        try:
            wait_for(lambda: all(_finished(engine, r) for r in runs), timeout=90, what="the 24 runs finished")
        finally:
            together.abort()
    assert {engine.get_run(r).status for r in runs} == {"SUCCEEDED"}


@contextlib.contextmanager
def _released(go: threading.Event) -> Iterator[None]:
    """Set ``go`` when the block ends, however: nothing stays held by the test."""
    try:
        yield
    finally:
        go.set()


def _hold_listener(monkeypatch: pytest.MonkeyPatch, connecting: threading.Event, go: threading.Event) -> None:
    """Hold the worker's LISTEN connection back: each connect sets ``connecting``, then
    waits for ``go``; real connections otherwise."""

    def held(*args: Any, **kwargs: Any) -> Any:
        connecting.set()
        assert go.wait(120), "the test never let the listener connect"
        return connect(*args, **kwargs)

    monkeypatch.setattr("composer_ops.engine.listener.connect", held)


def test_a_wake_up_handed_before_the_worker_listens_is_not_lost(db_url: str, engine: Engine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's first claim can commit, and hand the worker a wake-up for the task it
    left, before its LISTEN connection is up (the listener connects on a thread of its
    own; under load it is the slower): the NOTIFY reaches no one. Once listening, the
    worker reads the wake-ups handed to it so far, so it claims the task left without
    the poll (an hour here). Forced: the listener connects only after that claim."""
    first, second = engine.start("one"), engine.start("one")
    connecting, go = threading.Event(), threading.Event()
    _hold_listener(monkeypatch, connecting, go)
    w_engine = Engine.connect(db_url, pool_size=2)
    claim = w_engine.claim
    claimed = threading.Event()

    def noting(*args: Any, **kwargs: Any) -> Any:
        try:
            return claim(*args, **kwargs)
        finally:
            claimed.set()

    w_engine.claim = noting  # type: ignore[method-assign]
    with _serving(w_engine, "late-listener", 1), _released(go):
        assert connecting.wait(30), "the listener never tried to connect"
        if not claimed.wait(5):       # a worker that waits for its LISTEN first: let it listen
            go.set()
        wait_for(partial(_finished, engine, first), what=f"run {first}")
        go.set()
        wait_for(partial(_finished, engine, second), timeout=60, what=f"run {second} claimed without the poll")


def test_a_wake_up_handed_while_the_listen_connection_is_down_is_not_lost(
        db_url: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LISTEN connection is cut while the worker waits idle; a dispatch meanwhile
    hands the worker (still registered) a wake-up whose NOTIFY reaches no one. Once
    listening again, the worker reads what it was handed and claims the task without
    the poll (an hour here)."""
    connecting, go = threading.Event(), threading.Event()
    with _serving(Engine.connect(db_url, pool_size=2), "relistening", 2), _released(go):
        wait_for(lambda: _room(engine, "relistening") == 2, what="the worker idle")

        def listening() -> bool:
            with engine.pool.connection() as conn:
                return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'composer-listen' "
                                    "AND datname = current_database()").fetchone() == (1,)
        wait_for(listening, what="the worker listening")
        _hold_listener(monkeypatch, connecting, go)
        with engine.pool.connection() as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE application_name = 'composer-listen' AND datname = current_database()")
        assert connecting.wait(60), "the listener did not reconnect"
        run_id = engine.start("one")
        with engine.pool.connection() as conn:     # the dispatch handed it to the worker's registration
            assert conn.execute("SELECT promised FROM task_waiters WHERE worker = 'relistening'").fetchone() == (1,)
        go.set()
        wait_for(partial(_finished, engine, run_id), timeout=60, what=f"run {run_id} claimed without the poll")
        with engine.pool.connection() as conn:     # and took up what it read: nothing left on its way
            wait_for(lambda: conn.execute("SELECT promised - seen FROM task_waiters WHERE worker = 'relistening'"
                                          ).fetchone() == (0,), what="the wake-up taken up")


def test_a_registration_left_by_a_killed_process_of_the_same_id_is_taken_over(db_url: str,
                                                                              engine: Engine) -> None:
    """A process killed before it unregistered leaves its registration, whose totals count
    wake-ups handed to it; a new process with the same worker ID (a fixed ID, or one
    reused in a container) counts them as taken up: its first claim writes them so, and
    it makes no claim per stale wake-up (each would come back empty)."""
    with engine.pool.connection() as conn:
        conn.execute("INSERT INTO task_waiters (worker, channel, queues, slots, promised, seen) "
                     "VALUES ('reused', %s, ARRAY['default'], 4, 4000, 3998)", (outbox.wake_channel("reused"),))
    with _serving(Engine.connect(db_url, pool_size=2), "reused", 4) as worker:
        wait_for(lambda: _room(engine, "reused") == 4, what="the worker registered afresh")
        run_id = engine.start("one")
        wait_for(partial(_finished, engine, run_id), what=f"run {run_id}")
        counts = worker.claim_counts()
    assert sum(c["empty"] for c in counts.values()) <= 1, counts
    assert sum(c["claims"] for c in counts.values()) <= 3, counts


def test_a_stopping_worker_is_handed_no_wake_up_while_its_handlers_finish(db_url: str, engine: Engine) -> None:
    """A worker told to stop unregisters before it waits for its handlers: a task
    started meanwhile goes to an idle worker at once. Before, the stopping worker kept
    its registration (the most recent, with room) until its handlers finished, the
    dispatch handed it the task, and the task waited for another worker's poll (an
    hour here)."""
    release = threading.Event()

    def held_until_released(_input: Any, _ctx: Any) -> None:
        release.wait(120)

    try:
        with _serving(Engine.connect(db_url, pool_size=3), "idle", 1) as idle:
            wait_for(lambda: _room(engine, idle.worker_id) == 1, timeout=60, what="the idle worker registered")
            with _serving(Engine.connect(db_url, pool_size=4), "stopping", 2,
                          handler=held_until_released) as stopping:
                wait_for(lambda: _room(engine, stopping.worker_id) == 2, timeout=60,
                         what="the second worker registered after the first")
                held = engine.start("one")          # to the most recently registered: the second
                wait_for(lambda: _claimed_by(engine, held) == "stopping", timeout=60,
                         what="the second worker's claim")
                stopping.stop()                     # its handler runs on: it drains
                wait_for(lambda: not _registered(engine, stopping.worker_id), timeout=60,
                         what="the stopping worker's registration gone")
                run_id = engine.start("one")
                wait_for(partial(_finished, engine, run_id), timeout=60,
                         what="the run started while the other drained")
                assert _claimed_by(engine, run_id) == "idle"
                assert engine.get_run(held).status == "RUNNING"
                release.set()
            assert _finished(engine, held)
    finally:
        release.set()


def _registered(engine: Engine, worker: str) -> bool:
    with engine.pool.connection() as conn:
        return conn.execute("SELECT 1 FROM task_waiters WHERE worker = %s", (worker,)).fetchone() is not None


def _claimed_by(engine: Engine, run_id: str) -> str | None:
    with engine.pool.connection() as conn:
        row = conn.execute("SELECT worker FROM run_history WHERE run_id = %s AND kind = 'claimed'",
                           (run_id,)).fetchone()
    return None if row is None else row[0]


def test_the_registrations_of_workers_gone_are_forgotten(wakes: Wakes, engine: Engine) -> None:  # noqa: F811
    """A killed worker's registration outlives it. Not refreshed for a minute and its
    worker not live in the registry (dead, stopped or never there), it is deleted by the
    coordinator's lease loop (outbox.forget_dead); the wake-ups it had not taken up are
    told on the shared channel. Before, they counted as covering ready rows in every
    other worker's claim for good (composer_uncovered): a claim that filled its slots left
    such rows to the polls."""
    conn = wakes.conn
    for worker in ("a", "b"):        # a live for three hours: however slow this test runs
        workers.register(conn, worker, host="h", pid=1, queues=["default"], concurrency=2, heartbeat_s=3600)
    conn.execute("UPDATE workers SET last_seen_at = now() - interval '1 day' WHERE id = 'b'")    # b is dead
    for worker in ("a", "b", "c"):                                                               # c: never there
        wakes.idle(worker)
    wakes.dispatch()
    assert wakes.told() == [("c", "1")]

    def uncovered() -> int:
        row = conn.execute("SELECT composer_uncovered(ARRAY['default'], NULL, 'a', NULL, 10)").fetchone()
        return int(row[0]) if row else -1

    assert uncovered() == 0                        # the ready row counts as c's to claim
    assert outbox.forget_dead(conn) == 0           # all refreshed within the minute
    conn.execute("UPDATE task_waiters SET since = now() - interval '2 minutes'")
    assert outbox.forget_dead(conn) == 2
    assert sorted(r[0] for r in conn.execute("SELECT worker FROM task_waiters")) == ["a"]   # live, however old
    assert wakes.told() == [("shared", "default")]     # c's wake-up, not taken up
    assert uncovered() == 1
    wakes.idle("b", names=["other"])               # b back, refreshed: kept until it ages again
    assert outbox.forget_dead(conn) == 0
    conn.execute("UPDATE task_waiters SET since = now() - interval '2 minutes' WHERE worker = 'b'")
    assert engine.coordinator().run_once(["leases"]).waiters_forgotten == 1
    assert wakes.notified() == []                  # b had taken up all it was handed
