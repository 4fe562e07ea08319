"""A worker's attempts are tracked per attempt, not per task; shutdown has a deadline;
only the CLI entry point installs signal handlers, and puts the old ones back."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, TaskContext, Worker
from composer_ops.cli.run_cmds import stop_on_signals
from composer_ops.errors import Invalid, ShutdownTimeout
from composer_ops.testing.processes import Fleet, wait_for


def _task_row(db_url: str, run_id: str) -> tuple[str, int, Any]:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT state, attempt, lease_expires_at FROM task_instances WHERE run_id = %s",
                           (run_id,)).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def test_a_late_attempt_finishing_leaves_the_current_attempts_heartbeats_alone(db_url: str, engine: Engine) -> None:
    """Attempt 0 of a task hangs in this worker past its lease; the task comes back as
    attempt 1 to the same worker. When attempt 0 finally returns, attempt 1 must keep
    its entry and its heartbeats: its lease never lapses while its handler runs."""
    engine.deploy({"id": "zombie", "nodes": [
        {"id": "job", "type": "TASK", "task": "job", "lease_s": 6, "retry": {"max_attempts": 3}}]})
    run_id = engine.start("zombie")
    release = {0: threading.Event(), 1: threading.Event()}
    started: dict[int, TaskContext] = {}

    def job(input: Any, ctx: TaskContext) -> dict[str, Any]:
        started[ctx.attempt] = ctx
        release[ctx.attempt].wait(30)
        return {"attempt": ctx.attempt}

    worker = Worker(engine, concurrency=2, poll_interval=0.05)
    worker.handler("job")(job)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: 0 in started, timeout=60, what="attempt 0 to start")
        # Attempt 0's lease lapses (as after a long pause of its process) and is swept.
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("UPDATE task_instances SET lease_expires_at = now() - interval '1 second' "
                         "WHERE run_id = %s", (run_id,))
        assert engine.coordinator().run_once().leases_expired == 1
        wait_for(lambda: 1 in started, timeout=60, what="attempt 1 to start in the same worker")
        release[0].set()                                   # the late attempt returns (its result is stale)
        # Two leases and more of attempt 1: heartbeats (every 2 s) must have extended it.
        # A lease of 6 s leaves a loaded machine two missed beats before it would lapse.
        time.sleep(13.0)
        state, attempt, expires = _task_row(db_url, run_id)
        assert (state, attempt) == ("RUNNING", 1)
        assert not started[1].lease_lost, "attempt 1 lost its lease on a healthy worker"
        with psycopg.connect(db_url) as conn:
            row = conn.execute("SELECT %s > now()", (expires,)).fetchone()
        assert row is not None and row[0], "attempt 1's lease was not extended"
        release[1].set()
        wait_for(lambda: engine.get_run(run_id).status == "SUCCEEDED", timeout=60, what="the run to succeed")
        assert engine.get_run(run_id).output == {"job": {"attempt": 1}}
    finally:
        release[0].set()
        release[1].set()
        worker.stop()
        thread.join(60)


def test_shutdown_abandons_a_hung_handler_at_the_deadline_and_stops_its_lease(db_url: str,
                                                                             engine: Engine) -> None:
    engine.deploy({"id": "hang", "nodes": [{"id": "job", "type": "TASK", "task": "job", "lease_s": 1}]})
    run_id = engine.start("hang")
    entered = threading.Event()
    never = threading.Event()

    def job(input: Any, ctx: TaskContext) -> None:
        entered.set()
        never.wait(60)                                     # ignores ctx.lease_lost: hung

    worker = Worker(engine, concurrency=1, poll_interval=0.05, shutdown_timeout=0.5)
    worker.handler("job")(job)
    raised: list[BaseException] = []

    def serve() -> None:
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            raised.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert entered.wait(60)
        time.sleep(1.2)                                    # heartbeats keep the 1 s lease alive meanwhile
        assert _task_row(db_url, run_id)[0] == "RUNNING"
        stopped_at = time.monotonic()
        worker.stop()
        thread.join(60)
        assert not thread.is_alive(), "run() did not return at the shutdown deadline"
        assert time.monotonic() - stopped_at < 0.5 + 5.0        # not the hung handler's 60 s
        assert len(raised) == 1 and isinstance(raised[0], ShutdownTimeout), raised
        task_id = engine.get_run(run_id).tasks[0].id
        assert f"task {task_id} attempt 0" in str(raised[0])
        # No more heartbeats: the lease lapses, the sweeper re-queues the task. Swept
        # until then: a beat already under way when run() returned may have extended it
        # once more, and on a loaded machine that lands late.
        coordinator = engine.coordinator()
        expired: list[int] = []

        def swept() -> bool:
            expired.append(coordinator.run_once(["leases"]).leases_expired)
            return sum(expired) >= 1

        wait_for(swept, timeout=30, what="the abandoned task's lease to lapse and be swept")
        assert sum(expired) == 1
        state, attempt, _ = _task_row(db_url, run_id)
        assert (state, attempt) == ("PENDING", 1)
    finally:
        never.set()


def test_shutdown_waits_for_handlers_that_finish_in_time(engine: Engine) -> None:
    engine.deploy({"id": "quick", "nodes": [{"id": "job", "type": "TASK", "task": "job", "lease_s": 5}]})
    run_id = engine.start("quick")
    entered = threading.Event()

    def job(input: Any, ctx: TaskContext) -> dict[str, bool]:
        entered.set()
        time.sleep(0.5)
        return {"done": True}

    worker = Worker(engine, concurrency=1, poll_interval=0.05, shutdown_timeout=5)
    worker.handler("job")(job)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert entered.wait(60)
    worker.stop()
    thread.join(60)
    assert not thread.is_alive()
    assert engine.get_run(run_id).status == "SUCCEEDED"


def test_a_stop_before_run_is_not_lost_and_stays_final(engine: Engine) -> None:
    """run() used to clear its stop Event when it started: a stop() made before (a
    SIGTERM that reached the CLI between installing its handlers and run()) was lost, and
    the worker served on until a second signal. A stop is final: no run() after it claims."""
    engine.deploy({"id": "noop", "nodes": [{"id": "job", "type": "TASK", "task": "job"}]})
    run_id = engine.start("noop")
    worker = Worker(engine, concurrency=1, poll_interval=0.05)
    worker.handler("job")(lambda input, ctx: {"ok": True})
    worker.stop()
    for attempt in ("first", "second"):
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), f"the {attempt} run() ignored the stop() made before it"
        assert [t.state for t in engine.get_run(run_id).tasks] == ["PENDING"]   # nothing claimed


def test_a_stop_before_run_ends_the_coordinators_run_too(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    coordinator = engine.coordinator()
    passes: list[object] = []
    real = coordinator.run_once

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes.append(real(*args, **kwargs))
        return passes[-1]

    monkeypatch.setattr(coordinator, "run_once", counted)
    coordinator.stop()
    for attempt in ("first", "second"):
        thread = threading.Thread(target=coordinator.run, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), f"the coordinator's {attempt} run() ignored the stop() made before it"
    assert passes == []


def test_the_library_worker_installs_no_signal_handlers(engine: Engine) -> None:
    """run() on the main thread leaves SIGTERM and SIGINT to its host."""
    engine.deploy({"id": "noop", "nodes": [{"id": "job", "type": "TASK", "task": "job"}]})
    worker = Worker(engine, concurrency=1, poll_interval=0.05)
    worker.handler("job")(lambda input, ctx: None)

    def host_handler(signum: int, frame: Any) -> None:
        raise AssertionError("not expected to be called")

    before = {sig: signal.signal(sig, host_handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        timer = threading.Timer(0.5, worker.stop)
        timer.start()
        worker.run()                                       # on the main thread, as the CLI would
        timer.join()
        assert signal.getsignal(signal.SIGTERM) is host_handler
        assert signal.getsignal(signal.SIGINT) is host_handler
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_the_cli_handlers_are_restored_afterwards() -> None:
    calls: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    before_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before_fd)
    with stop_on_signals(lambda: calls.append("stop")):
        assert signal.getsignal(signal.SIGTERM) is not before
        signal.raise_signal(signal.SIGTERM)
        wait_for(lambda: calls == ["stop"], timeout=30, what="stop called by SIGTERM")
    assert calls == ["stop"]
    assert signal.getsignal(signal.SIGTERM) is before
    after_fd = signal.set_wakeup_fd(before_fd)
    assert after_fd == before_fd                       # the wake-up descriptor put back too


#: A process whose main thread holds the lock of the Event ``stop`` sets when SIGTERM
#: arrives, as a worker's main thread does inside its wake-up Event's wait or clear.
_HELD = """
import signal, sys, threading
from composer_ops.cli.run_cmds import stop_on_signals
stopped = threading.Event()
with stop_on_signals(stopped.set):
    with stopped._cond:
        signal.raise_signal(signal.SIGTERM)   # a Python handler would run here, on this thread
    sys.exit(0 if stopped.wait(20) else 3)
"""


def test_sigterm_while_the_main_thread_holds_the_stop_events_lock_stops_the_process() -> None:
    """The handler used to call ``stop`` itself, on the main thread: with that thread
    holding the lock of the Event ``stop`` sets, ``set()`` waited for it forever, and a
    worker ignored SIGTERM until it was killed (the flaky-test finder's chaos run)."""
    done = subprocess.run([sys.executable, "-c", _HELD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


#: A process that forks a child inside the block (as a task using multiprocessing does),
#: sends the child SIGTERM, and says whether the child died of it and this process did not stop.
_FORKED = """
import os, signal, sys, threading, time
from composer_ops.cli.run_cmds import stop_on_signals
stopped = threading.Event()
with stop_on_signals(stopped.set):
    ready, tell = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(tell, b"r")    # past Python's after-fork steps, which drop a signal pending then
        time.sleep(60)
        os._exit(7)
    assert os.read(ready, 1) == b"r"
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    died = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    sys.exit(0 if died and not stopped.wait(2) else 3)
"""


def test_sigterm_to_a_forked_child_ends_the_child_and_leaves_the_worker_running() -> None:
    """A child forked inside the block inherits the handler but not the thread that
    calls ``stop``: its SIGTERM must neither stop the parent (a wake-up descriptor shared
    with the parent did) nor be swallowed (the child would not end)."""
    done = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_bad_shutdown_timeout_is_refused() -> None:
    for bad in (-1, float("nan"), float("inf"), "3", True):
        with pytest.raises(Invalid, match="shutdown timeout"):
            Worker(Engine.__new__(Engine), shutdown_timeout=bad)  # type: ignore[arg-type]


def test_the_cli_worker_exits_1_naming_what_it_abandoned(db_url: str, engine: Engine) -> None:
    """SIGTERM to `composer-ops worker --shutdown-timeout 1` with a handler sleeping
    60 s: it exits 1 within the deadline (plus start-up slack), naming the task."""
    engine.deploy({"id": "sleepy", "nodes": [{"id": "job", "type": "TASK", "task": "work",
                                              "input": {"sleep": 60}}]})
    run_id = engine.start("sleepy")
    fleet = Fleet(db_url)
    try:
        proc = fleet.worker("--shutdown-timeout", "1", concurrency=1)
        wait_for(lambda: _task_row(db_url, run_id)[0] == "RUNNING", timeout=30, what="the task to be claimed")
        sent = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        try:
            code = proc.popen.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker did not exit within 10 s of SIGTERM with --shutdown-timeout 1")
        assert time.monotonic() - sent < 1 + 3
        err = proc.stderr()
        task_id = engine.get_run(run_id).tasks[0].id
        assert code == 1, err
        assert f"task {task_id} attempt 0" in err and "shutdowntimeout" in err, err
        assert "Traceback" not in err, err
    finally:
        fleet.stop()


def test_a_worker_that_does_not_stop_in_time_has_its_stacks_logged_before_the_kill(db_url: str,
                                                                                   engine: Engine) -> None:
    """A process still running when the fleet's stop deadline passes (here a worker told
    to wait 60 s for a handler sleeping 60 s, the fleet waiting 10 s) is sent SIGUSR1
    first: its log then shows where every thread was (the main one waiting for the
    handler), and the kill is recorded as a crash."""
    engine.deploy({"id": "sleepy", "nodes": [{"id": "job", "type": "TASK", "task": "work",
                                              "input": {"sleep": 60}}]})
    run_id = engine.start("sleepy")
    fleet = Fleet(db_url)
    try:
        proc = fleet.worker("--shutdown-timeout", "60", concurrency=1)
        wait_for(lambda: _task_row(db_url, run_id)[0] == "RUNNING", timeout=30, what="the task to be claimed")
        assert fleet.terminate("worker", timeout=10) == [proc]
        err = proc.stderr()
        assert fleet.crashes == [(proc, -signal.SIGKILL)], err
        assert "most recent call first" in err and "in _drain" in err, err
    finally:
        fleet.stop()
