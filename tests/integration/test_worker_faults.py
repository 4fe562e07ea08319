"""A worker that cannot heartbeat stops working on its task, and its result is dropped
as stale; a lease lost to a cancel is noticed the same way; no false alarms."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from composer_ops import Engine, TaskContext, Worker
from composer_ops.engine.worker import Result
from composer_ops.errors import NonRetryableError, Transient
from composer_ops.testing.processes import wait_for


def _deploy(engine: Engine, lease_s: float = 1) -> None:
    engine.deploy({"id": "long", "nodes": [
        {"id": "job", "type": "TASK", "task": "job", "lease_s": lease_s,
         "retry": {"max_attempts": 3, "initial_backoff_s": 0}}]})


class Running:
    """A Worker in a thread, with a handler that works until its lease is lost."""

    def __init__(self, engine: Engine, *, give_up_after: float = 8.0) -> None:
        self.results: list[Result] = []
        self.noticed: list[float] = []
        self.started: list[float] = []
        self.worker = Worker(engine, concurrency=1, poll_interval=0.1, on_result=self.results.append)

        @self.worker.handler("job")
        def job(input: Any, ctx: TaskContext) -> dict[str, Any]:
            self.started.append(time.monotonic())
            deadline = time.monotonic() + give_up_after
            while time.monotonic() < deadline:
                if ctx.lease_lost:
                    self.noticed.append(time.monotonic())
                    return {"partial": True}
                time.sleep(0.02)
            return {"done": True}

        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.stop()
        self.thread.join(60)


def test_failing_heartbeats_stop_the_handler_and_its_result_is_dropped(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    _deploy(engine, lease_s=1)
    run_id = engine.start("long")

    def unreachable(claim: Any) -> Any:
        raise Transient("server closed the connection unexpectedly")

    monkeypatch.setattr(engine, "heartbeat", unreachable)
    with Running(engine) as w:
        wait_for(lambda: w.results, timeout=60, what="the attempt to end")
    assert w.noticed, "the handler was never told that its lease was lost"
    assert w.noticed[0] - w.started[0] < 1.0 + 1.5          # by the lease's own clock; slack for a loaded machine
    assert [r.status for r in w.results] == ["stale"]
    task = engine.get_run(run_id).tasks[0]
    assert (task.state, task.attempt, task.output) == ("RUNNING", 0, None)   # nothing applied
    assert task.lease_expires_at is not None
    time.sleep(max(0.0, (task.lease_expires_at.timestamp() - time.time())) + 0.1)
    assert engine.coordinator().run_once().leases_expired == 1
    task = engine.get_run(run_id).tasks[0]
    assert (task.state, task.attempt) == ("PENDING", 1) and "lease" in str(task.error)


def test_a_lease_lost_to_a_cancel_stops_the_handler(engine: Engine) -> None:
    _deploy(engine, lease_s=1)
    run_id = engine.start("long")
    with Running(engine) as w:
        wait_for(lambda: w.started, timeout=60, what="the handler to start")
        engine.cancel(run_id, reason="stop it")
        wait_for(lambda: w.results, timeout=60, what="the attempt to end")
    assert w.noticed and [r.status for r in w.results] == ["stale"]
    run = engine.get_run(run_id)
    assert (run.status, run.tasks[0].state, run.tasks[0].output) == ("CANCELLED", "CANCELLED", None)


def test_a_finished_task_raises_no_lease_lost_alarm(engine: Engine, caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """While a completed task's report is still on its way back, the heartbeat loop
    must not beat it, find it off RUNNING and cry "lease lost"."""
    caplog.set_level(logging.WARNING, logger="composer_ops")
    # A lease of 3 s: the attempt's own lease, counted from before its claim, must not
    # lapse before the handler returns on a loaded machine (0.6 s could).
    engine.deploy({"id": "quick", "nodes": [{"id": "n", "type": "TASK", "task": "quick", "lease_s": 3}]})
    run_id = engine.start("quick")
    complete = engine.complete

    def slow_ack(claim: Any, output: Any, **kw: Any) -> Any:
        outcome = complete(claim, output, **kw)
        time.sleep(2.5)                   # committed; the acknowledgement is slow (heartbeats every 1 s)
        return outcome

    monkeypatch.setattr(engine, "complete", slow_ack)
    results: list[Result] = []
    worker = Worker(engine, concurrency=1, poll_interval=0.05, on_result=results.append)
    worker.handler("quick")(lambda input, ctx: {"ok": True})
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: results, timeout=60, what="the report")
    finally:
        worker.stop()
        thread.join(60)
    assert engine.get_run(run_id).status == "SUCCEEDED" and [r.status for r in results] == ["completed"]
    assert not [r for r in caplog.records if "lease lost" in r.getMessage()]


@pytest.mark.parametrize("raised", [SystemExit("bye"), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"])
def test_a_handler_raising_systemexit_fails_its_attempt_and_the_slot_goes_on(engine: Engine,
                                                                              raised: BaseException) -> None:
    """sys.exit() (or a KeyboardInterrupt raised) in a handler is the attempt's failure,
    not the end of its slot's thread: the one slot runs the next task."""
    engine.deploy({"id": "exits", "nodes": [{"id": "job", "type": "TASK", "task": "job",
                                             "input": {"exit": "$.input.exit"}, "retry": {"max_attempts": 1}}]})
    results: list[Result] = []
    worker = Worker(engine, concurrency=1, poll_interval=0.1, on_result=results.append)

    @worker.handler("job")
    def job(input: Any, ctx: TaskContext) -> dict[str, Any]:
        if input["exit"]:
            raise raised
        return {"ok": True}

    exiting = engine.start("exits", input={"exit": True})
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: engine.get_run(exiting).status == "FAILED", timeout=30, what="the exiting run failed")
        plain = engine.start("exits", input={"exit": False})
        wait_for(lambda: engine.get_run(plain).status == "SUCCEEDED", timeout=30, what="the next run, same slot")
    finally:
        worker.stop()
        thread.join(60)
    assert not thread.is_alive()
    failed = engine.get_run(exiting).tasks[0]
    assert type(raised).__name__ in str(failed.error), failed.error
    assert [r.status for r in results] == ["failed", "completed"]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str of the exception exploded")


@pytest.mark.parametrize(("raised", "shown"), [
    (NonRetryableError("bank\x00says no"), "NonRetryableError: bank\\x00says no"),
    (NonRetryableError("bad \udc80 byte"), "NonRetryableError: bad \\udc80 byte"),
    (_Unprintable(), "_Unprintable: (its message could not be read: str() raised RuntimeError)"),
], ids=["NUL", "lone-surrogate", "str-raises"])
def test_a_handler_error_the_database_cannot_store_as_it_is_still_fails_the_attempt(
        engine: Engine, raised: BaseException, shown: str) -> None:
    """Its report was refused (jsonb takes no NUL, UTF-8 no lone surrogate) or never
    made (str() raised while describing it): the task stayed RUNNING, ran again at each
    lease expiry, and failed as 'lease expired 4 times', NonRetryableError or not. Now
    the text is stored escaped, and the attempt fails once, as any other."""
    engine.deploy({"id": "odd", "nodes": [{"id": "job", "type": "TASK", "task": "job", "lease_s": 2,
                                           "retry": {"max_attempts": 3, "initial_backoff_s": 0}}]})
    results: list[Result] = []
    worker = Worker(engine, concurrency=1, poll_interval=0.1, on_result=results.append)
    calls: list[int] = []

    @worker.handler("job")
    def job(input: Any, ctx: TaskContext) -> None:
        calls.append(ctx.attempt)
        raise raised

    run_id = engine.start("odd")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: engine.get_run(run_id).status == "FAILED", timeout=60, what="the run failed")
    finally:
        worker.stop()
        thread.join(60)
    run = engine.get_run(run_id)
    expected_calls = [0] if isinstance(raised, NonRetryableError) else [0, 1, 2]
    assert calls == expected_calls and [r.status for r in results] == ["failed"] * len(calls), (calls, results)
    assert run.tasks[0].error == {"error": shown}, run.tasks[0].error
    assert "lease expired" not in str(run.error), run.error


def test_worker_misuse_is_refused_in_one_line(engine: Engine) -> None:
    from composer_ops.errors import Invalid

    for bad in ({"concurrency": "4"}, {"concurrency": 0}, {"concurrency": True}, {"poll_interval": 0},
                {"poll_interval": "1"}, {"registry_interval": None}):
        with pytest.raises(Invalid, match="must be"):
            Worker(engine, **bad)
    worker = Worker(engine)

    @worker.handler("job")
    def job(input: Any, ctx: TaskContext) -> None:
        return None

    with pytest.raises(Invalid, match=r"task 'job' has a handler already: .*\.job"):
        worker.handler("job")
    with pytest.raises(Invalid, match="the handler of task 'other' must be a function"):
        worker.handler("other")(5)        # type: ignore[arg-type]
    async def later(input: Any, ctx: TaskContext) -> None:
        return None

    class Awaits:
        async def __call__(self, input: Any, ctx: TaskContext) -> None:
            return None

    for coroutine in (later, Awaits()):
        with pytest.raises(Invalid, match=r"the handler of task 'async' is an async function \(.*\): a worker runs "):
            worker.handler("async")(coroutine)
    assert list(worker._handlers) == ["job"]


def test_a_handler_that_returns_an_awaitable_fails_its_attempt_once_saying_why(engine: Engine) -> None:
    """An async function registration cannot see (wrapped in a plain callable) returns a
    coroutine: the attempt fails, not retried, naming the cause (before: "is not JSON:
    coroutine at $"), and the coroutine is closed, not left to warn at collection."""
    import warnings

    async def later(input: Any, ctx: TaskContext, *, extra: int) -> int:
        return extra

    engine.deploy({"id": "awaits", "nodes": [{"id": "a", "type": "TASK", "task": "awaits",
                                             "retry": {"max_attempts": 3}}]})
    run_id = engine.start("awaits")
    results: list[Result] = []
    worker = Worker(engine, concurrency=1, poll_interval=0.05, on_result=results.append)
    worker.handler("awaits")(lambda input, ctx: later(input, ctx, extra=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)      # "coroutine ... was never awaited"
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: results, timeout=60, what="the attempt's result")
        finally:
            worker.stop()
            thread.join(60)
    run = engine.get_run(run_id)
    assert run.status == "FAILED", run
    (task,) = run.tasks
    assert task.attempt == 0        # the first attempt, not retried
    assert run.error == {"error": 'node "a" failed after 1 attempt: handler \'awaits\' returned an awaitable '
                         "(coroutine), not its output: async handlers are not supported (give a plain function)"}
