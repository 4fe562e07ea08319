"""``Worker``: runs task handlers for the queues it serves.

The ``run()`` thread claims tasks whenever a slot is free and hands them to
``concurrency`` handler threads, each lease extended by heartbeats; a handler whose
lease is lost has its result dropped as stale. An idle worker registers its free slots
and sleeps on LISTEN (woken on its own channel for k tasks it claims up to k; told on
the shared channel, or on its own with an empty payload, as many as it has room for;
either way leaving tasks a dispatch handed to other workers with wake-ups to take up
to them, for a second), polling as the fallback (a poll takes any task). A busy
worker is handed wake-ups beyond its room for tasks no worker has room for, and claims
them with its reports, each in the report's transaction; the reporting slot goes on to
its next task at once. With ``prefetch`` N, while its handlers are short (each of the
last ones finished within :data:`SHORT_HANDLER_S`, none running longer) and its last
claim for all its free slots got all it asked for, its claims take up to N tasks
beyond its free slots, held for the next slot that frees, their leases extended by
its heartbeats as a running task's. Everything about a running handler is keyed by its attempt, so
a late attempt finishing cannot touch the current one. ``run()`` installs no signal
handlers; after ``stop()`` it unregisters (no wake-up is handed to it, and those it had
not claimed for are told to the other workers), then waits at most
``shutdown_timeout`` seconds, then abandons what still runs and raises
:class:`~composer_ops.errors.ShutdownTimeout`.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from composer_ops.db.retry import backoff_delay
from composer_ops.engine import handlers
from composer_ops.engine.attempt import AttemptKey, Result, TaskContext, abandoned_at_shutdown
from composer_ops.engine.handlers import Handler
from composer_ops.engine.listener import Listener
from composer_ops.engine.report_claim import ReportClaim
from composer_ops.engine.worker_options import (
    check_concurrency,
    check_prefetch,
    check_seconds,
    check_shutdown_timeout,
)
from composer_ops.errors import ComposerError, Invalid, ShutdownTimeout
from composer_ops.repo import outbox
from composer_ops.repo._base import Conn
from composer_ops.repo.outbox import CHANNEL, wake_channel
from composer_ops.repo.rows import Claim

if TYPE_CHECKING:
    from composer_ops.engine.engine import Engine

__all__ = ["CLAIM_REASONS", "REPORT_WAIT_S", "SHORT_HANDLER_S", "Handler", "Result", "TaskContext", "Worker"]

log = logging.getLogger(__name__)

#: How long a woken worker's claim loop leaves its free slots to its reports under way,
#: which claim for them in their transactions, before it claims for them itself.
REPORT_WAIT_S = 0.05
#: A worker with ``prefetch`` claims ahead only while its handlers are short: each of
#: its last ``2 x concurrency`` (at least 8) finished within this many seconds, and none
#: running has run longer. A task it holds then waits for a slot about as long as
#: ``prefetch / concurrency`` (rounded up) handlers take; a handler that runs longer
#: stops the claims ahead at once.
SHORT_HANDLER_S = 0.5
#: What started a worker's claim, the keys of :meth:`Worker.claim_counts`.
CLAIM_REASONS = ("own", "shared", "room")

class Worker:
    """``Worker(engine, queues=[...], concurrency=N)`` with ``@worker.handler("name")``."""

    def __init__(self, engine: Engine, queues: Sequence[str] = ("default",), concurrency: int = 4, *,
                 poll_interval: float = 1.0, worker_id: str | None = None,
                 on_result: Callable[[Result], None] | None = None,
                 shutdown_timeout: float | None = None, registry_interval: float = 10.0,
                 prefetch: int = 0) -> None:
        if not queues or isinstance(queues, str | bytes) or any(not isinstance(q, str) or not q for q in queues):
            raise Invalid(f"queues must be a non-empty list of queue names, got {queues!r}")
        check_concurrency(concurrency)
        check_seconds("poll interval", poll_interval)
        check_shutdown_timeout(shutdown_timeout)
        check_prefetch(prefetch)
        check_seconds("registry interval", registry_interval, most=3600)
        self.engine = engine
        self.queues = list(queues)
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{id(self) & 0xFFFF:04x}"
        self.on_result = on_result
        #: seconds ``run()`` waits for handlers in flight after ``stop()``; None: as long as they take
        self.shutdown_timeout = shutdown_timeout
        #: Seconds between the worker's heartbeats in the workers registry: one small
        #: update per interval, however many tasks it runs.
        self.registry_interval = registry_interval
        #: Tasks its claims may take beyond its free slots while its handlers are short
        #: (:data:`SHORT_HANDLER_S`) and its claims find a backlog, held for the next
        #: slot that frees (:meth:`_ahead`).
        self.prefetch = prefetch
        self._handlers: dict[str, Handler] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        #: the channel only this worker listens on; its idle claims register it there
        self._wake_channel = wake_channel(self.worker_id)
        #: wake-ups handed to this worker on its own channel (the largest total a payload
        #: there carried), how many of them its claims took up, and whether the shared
        #: channel told it since its last claim began; guarded by _wake_lock
        self._promised = 0
        self._taken = 0
        self._told_all = False
        #: a claim has begun (so it may have registered this worker before it listened)
        self._claimed = False
        self._wake_lock = threading.Lock()
        #: the LISTEN connection is up (set once; its reconnects are told by _on_listening)
        self._listening = threading.Event()
        #: claims made and how many came back empty, by what started them (see claim_counts);
        #: guarded by _wake_lock
        self._claims: dict[str, list[int]] = {reason: [0, 0] for reason in CLAIM_REASONS}
        #: One claim at a time, the claim loop's or a report's (:class:`ReportClaim`),
        #: each of which writes the worker's registration for the room it counted.
        self._claim_lock = threading.Lock()
        #: reports under way that may claim (the claim loop leaves the free slots to them)
        self._reports = 0
        self._reports_done = threading.Condition(self._wake_lock)
        #: What the last claim left: "filled" (it took every free slot: registered with
        #: no room), "registered" (it registered its room at _left_at: wait for a wake-up,
        #: the poll interval from then at most), None (claim when a slot is free).
        #: Guarded by _wake_lock.
        self._left: str | None = None
        self._left_at = 0.0
        self._done = threading.Event()          # run() has returned: the heartbeat loop ends
        #: run() claims no more, nor do its reports: set as it ends, before it unregisters
        self._claims_over = threading.Event()
        self._inflight = 0            # handed to a slot and not yet finished; guarded by _active_lock
        self._idle = threading.Condition()      # notified whenever an attempt finishes
        #: held for a slot or running (the heartbeat loop extends their leases); guarded by _active_lock
        self._active: dict[AttemptKey, TaskContext] = {}
        self._active_lock = threading.Lock()
        #: how long its last handlers took (:meth:`_ahead`); guarded by _active_lock
        self._durations: collections.deque[float] = collections.deque(maxlen=max(8, 2 * concurrency))
        #: whether its last claim for every free slot or more got all it asked for: tasks
        #: may be left (:meth:`_note_backlog`, :meth:`_ahead`)
        self._backlog = False

    def handler(self, name: str) -> Callable[[Handler], Handler]:
        """Register the function that runs tasks whose node says ``"task": name``: one
        per name (a second is refused, not silently put in the first one's place)."""
        if not isinstance(name, str) or not name:
            raise Invalid("a handler needs a non-empty task name")
        handlers.check_free(self._handlers, name)

        def register(fn: Handler) -> Handler:
            handlers.register(self._handlers, name, fn)
            return fn

        return register

    def stop(self) -> None:
        """Ask ``run()`` to stop claiming and return once the handlers in flight finish
        (or ``shutdown_timeout`` passes). Thread-safe, and safe from a signal handler."""
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def task_names(self) -> list[str]:
        """The task names this worker has handlers for, in the order registered."""
        return list(self._handlers)

    # -- main loop ---------------------------------------------------------------

    def run(self) -> None:
        """Claim and run tasks until ``stop()``; then wait for the handlers in flight
        (at most ``shutdown_timeout`` seconds). Raises ``ShutdownTimeout`` naming the
        attempts abandoned at the deadline. A ``stop()`` is final, whenever it is made: one
        made before ``run()`` (a SIGTERM that reached the CLI while it set up) makes it
        return without claiming, as does any ``run()`` after it (a new Worker serves again)."""
        if not self._handlers:
            raise Invalid("the worker has no handlers; register one with @worker.handler(name)")
        self._done.clear()
        self._claims_over.clear()
        check_prefetch(self.prefetch)           # set after construction (the CLI's --prefetch)
        with self._active_lock:
            self._durations = collections.deque(maxlen=max(8, 2 * self.concurrency))
        self._backlog = False
        slots: queue.SimpleQueue[TaskContext | None] = queue.SimpleQueue()
        threads = [threading.Thread(target=self._slot, args=(slots,), name=f"composer-task-{i}", daemon=True)
                   for i in range(self.concurrency)]
        for thread in threads:
            thread.start()
        listener = Listener(self.engine.url, CHANNEL, self._on_notify, self._stop, also=[self._wake_channel],
                            on_listening=self._on_listening)
        listener.start()
        beat = threading.Thread(target=self._heartbeat_loop, name="composer-heartbeat", daemon=True)
        beat.start()
        registry = threading.Thread(target=self._registry_loop, args=(self._done,), name="composer-registry",
                                    daemon=True)
        registry.start()
        log.info("worker %s serving %s with %d slots", self.worker_id, self.queues, self.concurrency)
        try:
            self._claim_loop(slots)
        finally:
            # Reports under way may still hand out tasks they claimed: before the ends.
            with self._wake_lock:
                self._reports_done.wait_for(lambda: self._reports == 0, timeout=self.shutdown_timeout)
            # Nothing claims from here on (reports included, even after a claim loop that
            # raised): before the handlers in flight are waited for.
            self._claims_over.set()
            self._unregister()
            for _ in threads:
                slots.put(None)      # each idle slot thread takes one and ends
            abandoned = self._drain()
            self._done.set()
            listener.join(timeout=5)
            registry.join(timeout=5)
        if abandoned:
            raise ShutdownTimeout(abandoned_at_shutdown(self.worker_id, self.shutdown_timeout, abandoned))
        log.info("worker %s stopped", self.worker_id)

    def _claim_loop(self, slots: queue.SimpleQueue[TaskContext | None]) -> None:
        failures = 0          # claims failed in a row
        deferring: float | None = None      # since when this loop has left the free slots to reports
        self._adopt_registration()
        self._await_listening()
        while not self._stop.is_set():
            # Attempts in flight can exceed the slots (a claim that got more than it asked
            # for): no room then, as with every slot taken, until enough of them finish.
            free = self._free_slots()
            if free <= 0:
                self._wake.wait(self.poll_interval)
                self._wake.clear()
                continue
            self._wake.clear()
            if self._woken() and self._reports_under_way():
                # A report under way claims what this worker was woken for, for the free
                # slots with its own, in its transaction: left to it (its end wakes this
                # loop), for REPORT_WAIT_S at most.
                deferring = time.monotonic() if deferring is None else deferring
                left_s = REPORT_WAIT_S - (time.monotonic() - deferring)
                if left_s > 0:
                    self._wake.wait(left_s)
                    continue
            deferring = None
            wait_since: float | None = None
            failed: Exception | None = None
            with self._claim_lock:
                free = self._free_slots()
                if free <= 0:
                    continue
                with self._wake_lock:
                    woken = self._woken_locked()
                    left, since = (None, 0.0) if woken else (self._left, self._left_at)
                    self._left = None
                if left == "registered":
                    wait_since = since
                elif left == "filled" and self._register_idle(free):
                    # Slots freed after a claim that filled them and left nothing ready
                    # (it would have woken this worker): register the room instead of
                    # claiming. On Citus, or when registering fails, claim as the claim
                    # may have left tasks behind.
                    wait_since = time.monotonic()
                else:
                    claimed_at = time.monotonic()
                    # Ahead (prefetch), the claim may take more than the free slots: the
                    # wake-ups it takes up are counted up to that, its room stays the slots'.
                    ahead = self._claim_ahead(0)
                    taken = self._take_wakeups(max(free, ahead))
                    assert taken is not None
                    limit, reason, seen, _own, _told = taken
                    limit = max(limit, ahead)
                    try:
                        claims = self.engine.claim(self.queues, self.worker_id, limit,
                                                   task_names=list(self._handlers), wake=self._wake_channel,
                                                   room=free, seen=seen, busy=self._busy_runs(),
                                                   woken=reason != "room")
                    except Exception as exc:  # a connection lost beyond db_retry included: keep serving
                        failed = exc
                        self._count_claim(reason, [], None)
                    else:
                        self._count_claim(reason, claims, len(claims) >= free)
                        self._note_backlog(limit, free, len(claims))
                        self._hand_out(claims, claimed_at, slots)
            if wait_since is not None:
                self._wait_for_dispatch(wait_since)
            elif failed is not None:
                delay = self.claim_backoff(failures)
                failures += 1
                log.warning("claim failed (%d in a row; next claim in %.2fs): %s", failures, delay, failed)
                # Not woken by a dispatch or a slot freeing: each would make the next
                # failure come at once. Only stop() ends the pause early.
                self._stop.wait(delay)
            else:
                failures = 0

    def _hand_out(self, claims: Sequence[Claim], claimed_at: float,
                  slots: queue.SimpleQueue[TaskContext | None]) -> None:
        """Hand claimed tasks to the slots, each counted in flight from now."""
        for claim in claims:
            with self._active_lock:
                self._inflight += 1
            slots.put(self._hold(claim, claimed_at))

    def _hold(self, claim: Claim, claimed_at: float) -> TaskContext:
        """The attempt of a task claimed at ``claimed_at`` (monotonic, no later than the
        claim's transaction began): held until a slot runs it, its lease extended by the
        heartbeat loop meanwhile."""
        ctx = TaskContext(run_id=claim.run_id, node_id=claim.node_id, task_id=claim.task_id,
                          attempt=claim.attempt, task=claim.task_name, _worker=self, _claim=claim,
                          _held_until=claimed_at + claim.lease_s)
        with self._active_lock:
            self._active[ctx.key] = ctx
        return ctx

    def _ahead(self) -> int:
        """How many tasks a claim may take beyond the free slots: ``prefetch`` while the
        handlers are short (:data:`SHORT_HANDLER_S`) and the last claim for every free
        slot or more got all it asked for (:meth:`_note_backlog`; one that came back short
        found no backlog to take ahead: other workers woken for the tasks there are would
        find theirs taken), else none."""
        if not self.prefetch or not self._backlog:
            return 0
        now = time.monotonic()
        with self._active_lock:
            recent = self._durations
            if len(recent) < (recent.maxlen or 0) or max(recent) > SHORT_HANDLER_S:
                return 0
            if any(c._started is not None and not c._reporting and now - c._started > SHORT_HANDLER_S
                   for c in self._active.values()):
                return 0
        return self.prefetch

    def _note_backlog(self, limit: int, free: int, got: int) -> None:
        """What a claim that asked for ``limit`` tasks, for ``free`` slots, says of the
        backlog (:meth:`_ahead`): one that asked for every free slot or more says whether
        tasks were left (it got all it asked for) or not; one that asked for fewer (the
        wake-ups handed to this worker, rows kept for it) says nothing."""
        if limit >= free:
            self._backlog = got >= limit

    def _claim_ahead(self, reporting: int) -> int:
        """What a claim may take in all with the tasks it holds ahead (:meth:`_ahead`):
        up to ``concurrency + prefetch`` in flight, ``reporting`` of those in flight
        being reported (their slots take the next)."""
        ahead = self._ahead()
        if not ahead:
            return 0
        with self._active_lock:
            return self.concurrency + ahead - (self._inflight - reporting)

    def _reports_under_way(self) -> bool:
        with self._wake_lock:
            return self._reports > 0

    def _take_wakeups(self, free: int, *, woken: bool = False) -> tuple[int, str, int, int, bool] | None:
        """What a claim for ``free`` slots asks for, with the wake-ups it takes up counted
        taken: its limit, its reason (:data:`CLAIM_REASONS`), the wake-ups taken up in
        all (``seen``), and what it took (its own wake-ups, the shared channel's word)
        for :meth:`_give_back`. Wake-ups beyond the free slots stay owed: claimed when
        slots free. ``woken``: None unless the worker was woken for tasks."""
        with self._wake_lock:
            own, told_all = min(free, self._promised - self._taken), self._told_all
            if woken and not own and not told_all:
                return None
            self._taken += own
            self._told_all = False
            self._claimed = True
            seen = self._taken
        limit = own if own and not told_all else free
        return limit, "shared" if told_all else "own" if own else "room", seen, own, told_all

    def _give_back(self, own: int, told_all: bool) -> None:
        """Undo :meth:`_take_wakeups` for a claim that was not made."""
        with self._wake_lock:
            self._taken -= own
            self._told_all = self._told_all or told_all

    def _count_claim(self, reason: str, claims: Sequence[Claim], filled: bool | None) -> None:
        """Count a claim (of ``reason``; empty when it failed) and note what it left:
        ``filled``, it took every free slot; False, it registered the room it left;
        None: nothing to note (it failed, or took a slot's next task). A claim that took
        all it asked for and left tasks ready that no wake-up on its way covers handed this
        worker wake-ups for them
        (sql/R__claim.sql): as many as its room left, claimed when they arrive, or one
        when it filled every slot, claimed when a slot frees; with none the worker
        registers its room when a slot frees, never claiming on spec."""
        with self._wake_lock:
            counts = self._claims[reason]
            counts[0] += 1
            counts[1] += not claims
            if filled is not None:
                self._left = "filled" if filled else "registered"
                self._left_at = time.monotonic()

    def _register_idle(self, free: int) -> bool:
        with self._wake_lock:
            seen = self._taken
            self._claimed = True
        try:
            return self.engine.register_idle(self.queues, self.worker_id, list(self._handlers),
                                             wake=self._wake_channel, room=free, seen=seen)
        except Exception as exc:  # the claim registers it instead
            log.warning("could not register worker %s as idle: %s", self.worker_id, exc)
            return False

    def _unregister(self) -> None:
        """The worker claims no more: its registration goes, so no dispatch hands it a
        wake-up while its handlers in flight finish (a whole ``shutdown_timeout`` at
        most), and what it was woken for and had not claimed is told to the others
        (:meth:`Engine.unregister_idle`). Failing, it is logged: the registry's stop
        deletes the registration too, and the rows wait for the others' polls."""
        with self._wake_lock:
            seen, told = self._taken, self._told_all
        try:
            self.engine.unregister_idle(self.worker_id, seen=seen, told=told)
        except Exception as exc:
            log.warning("worker %s: could not unregister as idle: %s", self.worker_id, exc)

    def claim_backoff(self, failures: int) -> float:
        """Seconds to pause after a claim failed, ``failures`` claims having failed in a
        row before it: jittered, doubling from 0.05 s, capped at the poll interval (at
        least 1 s), so a database that refuses every claim sees about one claim per
        poll interval from each worker, not one per round trip."""
        return backoff_delay(failures, base=0.05, cap=max(1.0, self.poll_interval))

    def claim_counts(self) -> dict[str, dict[str, int]]:
        """Claims this worker made (its claim loop's, and those its reports made in their
        transactions) and how many came back empty, by what started each
        (:data:`CLAIM_REASONS`): ``own``, woken on its own channel only (up to one task
        per wake-up); ``shared``, told on the shared channel or on its own with an empty
        payload, or its LISTEN connection up again after a loss (all it has room for); ``room``,
        neither: its first claim, a slot freed while it was full, or the poll interval
        passed. Read by the benchmark to say where empty claims come from."""
        return {reason: {"claims": n, "empty": empty} for reason, (n, empty) in self._claims.items()}

    def _adopt_registration(self) -> None:
        """Before the first claim: a registration under this worker's ID is a previous
        process's (one killed before it could unregister, its ID reused), and the
        wake-ups it counts were handed to that process: they count as taken up, and the
        first claim (for all the room) writes them so. Otherwise the worker would make
        one claim per such wake-up, each empty. Reading fails: as if none (the claim
        that follows fails or registers the worker afresh)."""
        try:
            handed = self.engine.wakeups_handed(self.worker_id)
        except Exception as exc:
            log.warning("could not read worker %s's registration: %s", self.worker_id, exc)
            return
        with self._wake_lock:
            self._promised = max(self._promised, handed)
            self._taken = max(self._taken, handed)

    def _await_listening(self) -> None:
        """Before the first claim: wait (at most the poll interval, a stop ends it) for
        the LISTEN connection, so that the claim's registration, and a wake-up it hands
        this worker, are heard. A claim made without it is made up for by
        :meth:`_on_listening`."""
        deadline = time.monotonic() + self.poll_interval
        while not self._stop.is_set() and not self._listening.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.wait(left)
            self._wake.clear()

    def _on_listening(self, conn: Conn) -> None:
        """The LISTEN connection ``conn`` is up (the first, or again after a loss). A
        notification sent while none listened reached no one: the wake-ups handed to this
        worker meanwhile are read from its registration (their total, as a payload on its
        channel carries it), and, when a claim may have registered it before (the shared
        channel's announcements are not kept anywhere), it claims for all its room.

        Reading fails: the worker claims for all its room, as after a loss, and the
        LISTEN stays up."""
        try:
            promised = outbox.promised(conn, self.worker_id)
        except ComposerError as exc:
            log.warning("could not read the wake-ups handed to worker %s: %s", self.worker_id, exc)
            promised = None
        with self._wake_lock:
            if promised is not None:
                self._promised = max(self._promised, promised)
            self._told_all = self._told_all or self._claimed or promised is None
        self._listening.set()
        self._wake.set()

    def _wait_for_dispatch(self, since: float | None = None) -> None:
        """After a claim (which registered this worker with the room it left) made at
        ``since`` (monotonic; default now): wait for a notification, a stop or the poll
        interval from then. A handler finishing meanwhile does not end the wait: a
        dispatch hands out the room, and a claim that filled the slots and left tasks
        behind woke this worker itself; claiming without either would come back empty."""
        deadline = (time.monotonic() if since is None else since) + self.poll_interval
        while not self._stop.is_set() and not self._woken():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.wait(left)
            self._wake.clear()

    def _drain(self) -> list[TaskContext]:
        """Wait for the attempts in flight, up to the shutdown deadline; abandon the rest."""
        deadline = None if self.shutdown_timeout is None else time.monotonic() + self.shutdown_timeout
        with self._idle:
            while self._free_slots() < self.concurrency:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle.wait(0.5 if left is None else min(0.5, left))
        with self._active_lock:
            if self._inflight == 0:
                return []
            abandoned = sorted(self._active.values(), key=lambda c: c.key)
            for ctx in abandoned:
                ctx._abandoned = True
        for ctx in abandoned:
            # A handler still running keeps its lease to the end (it may yet finish, and the
            # task must not run twice at once); a held task, never started, gives its up now.
            if ctx._started is not None:
                doing, lease = "still running", "the lease is no longer extended"
            else:
                doing, lease = "not started (held for a slot)", self._give_up_lease(ctx._claim)
            log.warning("abandoning task %s attempt %d of run %s at shutdown: its handler is %s; %s",
                        ctx.task_id, ctx.attempt, ctx.run_id, doing, lease,
                        extra={"action": "abandon", "run_id": ctx.run_id})
            self._note_loss(ctx._claim, f"abandoned at shutdown: the handler was {doing} after "
                                        f"{self.shutdown_timeout:g}s; {lease}")
        return abandoned

    def _give_up_lease(self, claim: Claim) -> str:
        """End a held task's lease, so the sweeper re-queues it at its next pass rather
        than once the lease lapses; what became of the lease, for the log and history."""
        try:
            ended = self.engine.end_lease(claim)
        except Exception as exc:     # the database may be what failed: the lease lapses in its time
            log.warning("could not end the lease of task %s in run %s: %s", claim.task_id, claim.run_id, exc)
            return "the lease is no longer extended"
        return "its lease was ended, for the lease sweeper to re-queue it" if ended else "its lease was lost already"

    def _note_loss(self, claim: Claim, reason: str) -> None:
        """Record in the run's history that this worker gave up the attempt (best effort:
        the database may be what failed)."""
        try:
            self.engine.lease_lost(claim, reason)
        except Exception as exc:
            log.warning("could not record the lost lease of task %s in run %s's history: %s", claim.task_id,
                        claim.run_id, exc)

    def _slot(self, slots: queue.SimpleQueue[TaskContext | None]) -> None:
        while (item := slots.get()) is not None:
            # The slot goes on with the task its report claimed, if any (:meth:`_report`).
            while item is not None:
                nxt: TaskContext | None = None
                try:
                    nxt = self._execute(item, slots=slots)
                except BaseException:   # never the slot's end: its thread takes the next task
                    log.exception("the slot running task %s of run %s failed after its handler (a result not "
                                  "reported comes back when its lease lapses)", item.task_id, item.run_id)
                finally:
                    if nxt is None:
                        self._release()
                item = nxt

    def _next_after_held(self, claimed: Sequence[Claim], claimed_at: float,
                         slots: queue.SimpleQueue[TaskContext | None]) -> TaskContext | None:
        """A report's slot's next task while tasks wait for a slot (:meth:`_holding`):
        the oldest of them, with the tasks ``claimed`` with the report queued after it,
        so no task claimed ahead waits behind newer ones. The reporting slot's count in
        flight goes to the task returned, never counted twice. None (none held any more,
        none claimed): the slot releases its count and takes from the queue."""
        fresh = [self._hold(claim, claimed_at) for claim in claimed]
        end = False                  # took a slot's end (run() ends the slots): put back last
        try:
            head = slots.get_nowait()
            end = head is None
        except queue.Empty:
            head = None
        if head is None:
            if not fresh:
                if end:
                    slots.put(None)
                return None
            head, fresh = fresh[0], fresh[1:]
            more = len(fresh)        # the slot's count goes to the first claimed
        else:
            more = len(fresh) - 1    # the oldest held was counted; the slot's task is done
        with self._active_lock:
            self._inflight += more
        for ctx in fresh:
            slots.put(ctx)
        if end:
            slots.put(None)
        if more < 0:
            with self._idle:
                self._idle.notify_all()
            self._wake.set()
        return head

    def _holding(self) -> bool:
        """Whether tasks claimed ahead wait for a slot: more in flight than slots."""
        with self._active_lock:
            return self._inflight > self.concurrency

    def _free_slots(self) -> int:
        with self._active_lock:
            return self.concurrency - self._inflight

    def _busy_runs(self, besides: AttemptKey | None = None) -> tuple[str, ...]:
        """The runs of the attempts this worker runs (but ``besides``): a claim takes
        their ready tasks after other runs' (``busy`` of :meth:`Engine.claim`), so the
        slots' reports do not queue for one run's lock."""
        with self._active_lock:
            return tuple(sorted({c.run_id for k, c in self._active.items() if k != besides}))

    def _release(self) -> None:
        with self._active_lock:
            self._inflight -= 1
        with self._idle:
            self._idle.notify_all()
        self._wake.set()

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == self._wake_channel and payload:
            try:
                promised = int(payload)
            except ValueError:
                return
            with self._wake_lock:
                self._promised = max(self._promised, promised)
        elif payload in self.queues or channel == self._wake_channel:
            # The shared channel's word, or the same on its own channel (an empty payload:
            # told with no wake-up handed, sql/R__dispatch.sql): claim all it has room for.
            with self._wake_lock:
                self._told_all = True
        else:
            return
        self._wake.set()

    def _woken(self) -> bool:
        with self._wake_lock:
            return self._woken_locked()

    def _woken_locked(self) -> bool:
        """Woken for tasks: told, or handed wake-ups not yet taken up (_wake_lock held)."""
        return self._told_all or self._promised > self._taken

    # -- one attempt ---------------------------------------------------------------

    def _execute(self, ctx: TaskContext, *,
                 slots: queue.SimpleQueue[TaskContext | None] | None = None) -> TaskContext | None:
        """Run the handler of ``ctx`` (:meth:`_hold`) and report its result. With
        ``slots``, the report may claim the next tasks (:meth:`_report`): this slot's is
        returned."""
        claim = ctx._claim
        try:
            started = time.monotonic()
            with self._active_lock:
                abandoned = ctx._abandoned
                if not abandoned:
                    ctx._started = started
            if abandoned:        # held for a slot when shutdown gave up (_drain): never started
                return None
            found_gone = ctx._lost      # a heartbeat while it was held found the lease gone
            if ctx.lease_lost:   # held (a slow report's retries, a queue) past its lease, or lost: not run
                why = ctx._loss if found_gone else "its lease ran out"
                self._dropped(claim, f"{why} before the handler started")
                self._note_loss(claim, f"{why} before the handler started; the handler was not run")
                return None
            outcome = self._call(claim, ctx)
            with self._active_lock:
                self._durations.append(time.monotonic() - started)
            ctx._reporting = True
            if ctx.lease_lost:   # the handler may have stopped half-way: never apply what it returned
                self._dropped(claim, "its lease was lost while the handler ran")
                self._note_loss(claim, f"{ctx._loss}; the result was dropped")
            else:
                return self._report(claim, *outcome, slots=slots)
        except Exception:  # reporting failed beyond retries: the lease sweeper will retry the task
            log.exception("could not report the result of task %s of run %s", claim.task_id, claim.run_id)
        finally:
            with self._active_lock:
                if self._active.get(ctx.key) is ctx:
                    del self._active[ctx.key]
        return None

    def _call(self, claim: Claim, ctx: TaskContext) -> tuple[str, Any, bool]:
        return handlers.call(self._handlers[claim.task_name], claim.task_name, claim.input, ctx)

    def _report(self, claim: Claim, status: str, value: Any, retryable: bool, *,
                slots: queue.SimpleQueue[TaskContext | None] | None = None) -> TaskContext | None:
        """Report the attempt's result. With ``slots``, the report may claim the next
        tasks in its transaction (:class:`ReportClaim`): this slot's next, returned, and
        the others (handed to ``slots``)."""
        then = ReportClaim(self, (claim.task_id, claim.attempt)) if slots is not None and not self._stop.is_set() \
            and self.engine.claims_with_events else None
        claimed: tuple[Claim, ...] | None = None
        nxt = None
        try:
            if status == "completed":
                outcome = self.engine.complete(claim, value, claim_next=then)
            else:
                outcome = self.engine.fail(claim, str(value), retryable=retryable, claim_next=then)
            claimed = outcome.claimed
        except BaseException:
            if then is not None and then.claim_id is not None:
                # It may have committed: then its tasks wait out their leases.
                log.warning("the report of task %s (run %s) failed with claim %s of worker %s in its transaction",
                            claim.task_id, claim.run_id, then.claim_id, self.worker_id)
            raise
        finally:
            if then is not None:
                assert slots is not None
                nxt = then.finish(claimed, slots)
        if outcome.stale:
            log.info("dropped stale result of task %s (run %s, attempt %d): %s", claim.task_id, claim.run_id,
                     claim.attempt, outcome.stale, extra={"action": "stale", "run_id": claim.run_id})
            status = "stale"
        if self.on_result:
            try:
                self.on_result(Result(claim, status, outcome.stale or ""))
            except BaseException:       # SystemExit too: the slot's next task must not be lost with it
                if nxt is None:
                    raise
                log.exception("the result callback failed for task %s of run %s", claim.task_id, claim.run_id)
        return nxt

    def _dropped(self, claim: Claim, reason: str) -> None:
        log.info("dropped stale result of task %s (run %s, attempt %d): %s", claim.task_id, claim.run_id,
                 claim.attempt, reason, extra={"action": "stale", "run_id": claim.run_id})
        if self.on_result:
            self.on_result(Result(claim, "stale", reason))

    # -- leases --------------------------------------------------------------------

    def _beat(self, ctx: TaskContext) -> bool:
        if ctx.lease_lost:
            return False
        if ctx._abandoned:   # shutdown gave up on it: let the lease lapse
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
            ctx._loss = "a heartbeat found the lease gone (the task was cancelled, re-queued or taken over)"
            log.warning("lease lost for task %s of run %s (attempt %d); its result will be dropped",
                        ctx.task_id, ctx.run_id, ctx.attempt)
            return False
        ctx._held_until = began + ctx._claim.lease_s
        return True

    def _registry_loop(self, done: threading.Event) -> None:
        """Register, then show a sign of life every ``registry_interval`` until ``run()``
        is done, then record the clean stop. A failed write is retried next interval
        (registering again if the row is missing): the registry is for operators, and
        a worker keeps serving while the database is unreachable."""
        registered = False
        while True:
            try:
                if not registered or not self.engine.worker_alive(self.worker_id):
                    self.engine.register_worker(self.worker_id, host=socket.gethostname(), pid=os.getpid(),
                                                queues=self.queues, concurrency=self.concurrency,
                                                heartbeat_s=self.registry_interval)
                registered = True
            except Exception as exc:  # never let the registry stop the worker
                log.warning("worker %s: registry heartbeat failed: %s", self.worker_id, exc)
            if done.wait(self.registry_interval):
                break
        try:
            self.engine.worker_stopped(self.worker_id)
        except Exception as exc:
            log.warning("worker %s: could not record the stop in the registry: %s", self.worker_id, exc)

    def _heartbeat_loop(self) -> None:
        last: dict[AttemptKey, float] = {}
        while not self._done.is_set():
            now = time.monotonic()
            with self._active_lock:
                running = [c for c in self._active.values() if not c._abandoned]
            for ctx in running:
                due = last.get(ctx.key, now) + max(0.2, ctx._claim.lease_s / 3)
                if ctx.key not in last:
                    last[ctx.key] = now
                elif now >= due:
                    self._beat(ctx)
                    last[ctx.key] = now
            for gone in set(last) - {c.key for c in running}:
                last.pop(gone, None)
            self._done.wait(0.1)
