"""``Worker``: runs task handlers for the queues it serves (SPEC section 6).

The main thread claims tasks (one statement each batch) whenever a slot is free and
hands them to a thread pool of ``concurrency`` handlers. While a handler runs, a
heartbeat extends its lease every third of the lease; if the lease is lost the
handler's result will be dropped as stale (the fenced completion refuses it). Idle
workers sleep on LISTEN (woken by the NOTIFY of a dispatch) with polling as the
fallback, which also picks up retries whose backoff has passed.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from composer_ops.engine.jsonvalues import check_json
from composer_ops.engine.listener import Listener
from composer_ops.errors import ComposerError, Invalid, NonRetryableError
from composer_ops.repo.outbox import CHANNEL
from composer_ops.repo.rows import Claim

if TYPE_CHECKING:
    from composer_ops.engine.engine import Engine

log = logging.getLogger(__name__)

Handler = Callable[[Any, "TaskContext"], Any]


@dataclass
class TaskContext:
    """What a handler knows about the attempt it runs: ``ctx.heartbeat()`` extends
    the lease now (long handlers between natural checkpoints); ``ctx.lease_lost``
    turns true when the lease is gone (cancelled, re-queued, taken over) or can no
    longer be known to be held (heartbeats failed for a whole lease). Once it is
    true the result will be dropped, so a long handler should poll it and stop."""

    run_id: str
    node_id: str
    task_id: str
    attempt: int
    task: str
    _worker: Worker = field(repr=False)
    _claim: Claim = field(repr=False)
    #: monotonic instant until which the lease is surely held: lease_s after the start
    #: of the claim or of the last heartbeat that extended it (the database's expiry
    #: is later, counted from inside those statements).
    _held_until: float = field(default=math.inf, repr=False)
    _lost: bool = field(default=False, repr=False)
    _reporting: bool = field(default=False, repr=False)

    @property
    def lease_lost(self) -> bool:
        if not self._lost and time.monotonic() >= self._held_until:
            self._lost = True
        return self._lost

    def heartbeat(self) -> bool:
        """Extend the lease; False when it is lost (stop working: the result is stale)."""
        return self._worker._beat(self)


@dataclass(frozen=True)
class Result:
    """How one attempt ended, for callers that count (the simulator, tests)."""

    claim: Claim
    status: str          # "completed" | "failed" | "stale"
    detail: str = ""


class Worker:
    """``Worker(engine, queues=[...], concurrency=N)`` with ``@worker.handler("name")``."""

    def __init__(self, engine: Engine, queues: Sequence[str] = ("default",), concurrency: int = 4, *,
                 poll_interval: float = 1.0, worker_id: str | None = None,
                 on_result: Callable[[Result], None] | None = None) -> None:
        if not queues or any(not isinstance(q, str) or not q for q in queues):
            raise Invalid(f"queues must be a non-empty list of queue names, got {queues!r}")
        if concurrency < 1:
            raise Invalid(f"concurrency must be at least 1, got {concurrency}")
        self.engine = engine
        self.queues = list(queues)
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{id(self) & 0xFFFF:04x}"
        self.on_result = on_result
        self._handlers: dict[str, Handler] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._inflight = 0            # submitted and not yet finished; main thread adds, callbacks subtract
        self._active: dict[str, TaskContext] = {}
        self._active_lock = threading.Lock()

    def handler(self, name: str) -> Callable[[Handler], Handler]:
        """Register the function that runs tasks whose node says ``"task": name``."""
        if not isinstance(name, str) or not name:
            raise Invalid("a handler needs a non-empty task name")

        def register(fn: Handler) -> Handler:
            self._handlers[name] = fn
            return fn

        return register

    def stop(self) -> None:
        """Ask ``run()`` to return after the handlers in flight finish (thread-safe)."""
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- main loop ---------------------------------------------------------------

    def run(self) -> None:
        """Claim and run tasks until ``stop()`` or SIGTERM/SIGINT."""
        if not self._handlers:
            raise Invalid("the worker has no handlers; register one with @worker.handler(name)")
        self._stop.clear()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        listener = Listener(self.engine.url, CHANNEL, self._on_notify, self._stop)
        listener.start()
        beat = threading.Thread(target=self._heartbeat_loop, name="composer-heartbeat", daemon=True)
        beat.start()
        log.info("worker %s serving %s with %d slots", self.worker_id, self.queues, self.concurrency)
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="composer-task") as pool:
            while not self._stop.is_set():
                free = self._free_slots()
                if free == 0:
                    self._wake.wait(self.poll_interval)
                    self._wake.clear()
                    continue
                claimed_at = time.monotonic()
                try:
                    claims = self.engine.claim(self.queues, self.worker_id, free, task_names=list(self._handlers))
                except ComposerError as exc:
                    log.warning("claim failed: %s", exc)
                    claims = []
                except Exception as exc:  # a connection lost beyond db_retry: keep serving
                    log.warning("claim failed: %s", exc)
                    claims = []
                for claim in claims:
                    with self._active_lock:
                        self._inflight += 1
                    fut: Future[None] = pool.submit(self._execute, claim, claimed_at)
                    fut.add_done_callback(lambda _f: self._release())
                if len(claims) < free:
                    self._wake.wait(self.poll_interval)
                    self._wake.clear()
        listener.join(timeout=5)
        log.info("worker %s stopped", self.worker_id)

    def _free_slots(self) -> int:
        with self._active_lock:
            return self.concurrency - self._inflight

    def _release(self) -> None:
        with self._active_lock:
            self._inflight -= 1
        self._wake.set()

    def _on_notify(self, payload: str) -> None:
        if payload in self.queues:
            self._wake.set()

    # -- one attempt ---------------------------------------------------------------

    def _execute(self, claim: Claim, claimed_at: float) -> None:
        ctx = TaskContext(run_id=claim.run_id, node_id=claim.node_id, task_id=claim.task_id,
                          attempt=claim.attempt, task=claim.task_name, _worker=self, _claim=claim,
                          _held_until=claimed_at + claim.lease_s)
        with self._active_lock:
            self._active[claim.task_id] = ctx
        try:
            outcome = self._call(claim, ctx)
            ctx._reporting = True
            if ctx.lease_lost:   # the handler may have stopped half-way: never apply what it returned
                self._dropped(claim, "its lease was lost while the handler ran")
            else:
                self._report(claim, *outcome)
        except Exception:  # reporting failed beyond retries: the lease sweeper will retry the task
            log.exception("could not report the result of task %s of run %s", claim.task_id, claim.run_id)
        finally:
            with self._active_lock:
                self._active.pop(claim.task_id, None)

    def _call(self, claim: Claim, ctx: TaskContext) -> tuple[str, Any, bool]:
        fn = self._handlers[claim.task_name]
        try:
            output = fn(claim.input, ctx)
        except NonRetryableError as exc:
            return "failed", _describe(exc), False
        except Exception as exc:
            log.debug("handler %s raised: %s", claim.task_name, traceback.format_exc())
            return "failed", _describe(exc), True
        try:
            check_json(output, f"output of handler {claim.task_name!r}")
        except Invalid as exc:
            return "failed", str(exc), False
        return "completed", output, True

    def _report(self, claim: Claim, status: str, value: Any, retryable: bool) -> None:
        if status == "completed":
            outcome = self.engine.complete(claim, value)
        else:
            outcome = self.engine.fail(claim, str(value), retryable=retryable)
        if outcome.stale:
            log.info("dropped stale result of task %s (run %s, attempt %d): %s", claim.task_id, claim.run_id,
                     claim.attempt, outcome.stale, extra={"action": "stale", "run_id": claim.run_id})
            status = "stale"
        if self.on_result:
            self.on_result(Result(claim, status, outcome.stale or ""))

    def _dropped(self, claim: Claim, reason: str) -> None:
        log.info("dropped stale result of task %s (run %s, attempt %d): %s", claim.task_id, claim.run_id,
                 claim.attempt, reason, extra={"action": "stale", "run_id": claim.run_id})
        if self.on_result:
            self.on_result(Result(claim, "stale", reason))

    # -- leases --------------------------------------------------------------------

    def _beat(self, ctx: TaskContext) -> bool:
        if ctx.lease_lost:
            return False
        began = time.monotonic()
        try:
            extended = self.engine.heartbeat(ctx._claim)
        except Exception as exc:  # cannot reach the database: held only until the last lease runs out
            log.warning("heartbeat for task %s failed: %s", ctx.task_id, exc)
            return not ctx.lease_lost
        if extended is None:
            if ctx._reporting:    # the result being reported moved the task off RUNNING: not a loss
                return True
            ctx._lost = True
            log.warning("lease lost for task %s of run %s (attempt %d); its result will be dropped",
                        ctx.task_id, ctx.run_id, ctx.attempt)
            return False
        ctx._held_until = began + ctx._claim.lease_s
        return True

    def _heartbeat_loop(self) -> None:
        last: dict[str, float] = {}
        while not (self._stop.is_set() and not self._active):
            now = time.monotonic()
            with self._active_lock:
                running = list(self._active.values())
            for ctx in running:
                due = last.get(ctx.task_id, now) + max(0.2, ctx._claim.lease_s / 3)
                if ctx.task_id not in last:
                    last[ctx.task_id] = now
                elif now >= due:
                    self._beat(ctx)
                    last[ctx.task_id] = now
            for gone in set(last) - {c.task_id for c in running}:
                last.pop(gone, None)
            time.sleep(0.1)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
