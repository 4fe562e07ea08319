"""The claim a worker's report makes in its own transaction (:class:`ReportClaim`), one
concern of :class:`~composer_ops.engine.worker.Worker`, whose state it reads and
updates under the worker's locks."""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

from composer_ops.repo.outbox import ClaimAsk
from composer_ops.repo.rows import Claim

if TYPE_CHECKING:
    from composer_ops.engine.attempt import TaskContext
    from composer_ops.engine.worker import Worker


class ReportClaim:
    """The claim a report makes in its transaction (``claim_next`` of
    :meth:`Engine.complete <composer_ops.engine.engine.Engine.complete>`), the claim the
    claim loop would make for the free slots and the reporting one: one transaction
    fewer per task, and the slot goes on to its next task at once.

    Decided when the report's write is about to be sent (:meth:`ask`): only when the
    worker was woken for tasks (its own wake-ups or the shared channel's word) and is not
    stopping. With free slots, and the worker's claim lock free, it takes the lock there
    and holds it until :meth:`finish`, claiming for those slots too, as the claim loop
    would (which takes the same lock): the two never claim for the same slot; so too,
    with the lock, for the tasks the worker may hold ahead (``prefetch``). While the
    worker holds such tasks and the lock is not to be had, it makes no claim: its slot
    takes the oldest held task next. Otherwise
    it claims for the reporting slot alone, which no other claim counts, without the
    lock: a report never waits for it (it holds a connection and its run's row lock;
    the claim loop may be waiting for a connection with the lock held), and the reports
    of a busy worker claim side by side. Wake-ups are taken atomically either way. A
    woken claim loop leaves its free slots to reports under way for
    :data:`REPORT_WAIT_S` at most. ``run()`` hands out what reports under way claim
    before it ends its slots."""

    def __init__(self, worker: Worker, reporting: tuple[str, int]) -> None:
        self._worker = worker
        self._reporting = reporting      # the attempt reported: its run is not busy for it
        self._ask: ClaimAsk | None = None
        self._declined = False
        self._locked = False
        self._free = 0
        self._limit = 0
        self._reason = ""
        self._own = 0
        self._told_all = False
        #: when the report began: no later than its transaction's start, whose clock
        #: the claim's leases count from (the worker's view of a lease ends no later)
        self._at = time.monotonic()
        with worker._wake_lock:
            worker._reports += 1

    @property
    def claim_id(self) -> str | None:
        return None if self._ask is None else self._ask.claim_id

    def ask(self) -> ClaimAsk | None:
        w = self._worker
        if self._ask is not None or self._declined:
            return self._ask
        if w._stop.is_set() or w._claims_over.is_set() or not w._woken():
            self._declined = True
            return None
        if (w._free_slots() > 0 or w._ahead()) and w._claim_lock.acquire(blocking=False):
            self._locked = True
        elif w._holding():
            # Tasks wait for a slot (claimed ahead): this slot takes the first of them, so a
            # claim for it alone would put a new task before them.
            self._declined = True
            return None
        try:
            free = max(w._free_slots(), 0) + 1 if self._locked else 1      # the reporting slot's too
            ahead = w._claim_ahead(1) if self._locked else 0
            taken = w._take_wakeups(max(free, ahead), woken=True)
            if taken is None:                     # the claim loop took the wake-ups meanwhile
                self._declined = True
                self._release()
                return None
            limit, self._reason, seen, self._own, self._told_all = taken
            limit = max(limit, ahead)
            self._free = free
            self._limit = limit
            self._ask = w.engine.next_claim(w.queues, w.worker_id, limit, list(w._handlers), wake=w._wake_channel,
                                            room=free, seen=seen, busy=w._busy_runs(self._reporting),
                                            woken=True)
        except BaseException:
            self._release()
            raise
        return self._ask

    def asked(self) -> ClaimAsk | None:
        return self._ask

    def finish(self, claimed: tuple[Claim, ...] | None,
               slots: queue.SimpleQueue[TaskContext | None]) -> TaskContext | None:
        """After the report (``claimed``: ``Outcome.claimed``, None when it failed):
        count the claim, hand the tasks past the first to ``slots``, give back the
        wake-ups of a claim not made, release the claim lock. Returns the first task."""
        w = self._worker
        try:
            if self._ask is None:
                return None
            if claimed is None:          # not made (the report was not one write), or the report failed
                w._give_back(self._own, self._told_all)
                return None
            # What the claim left, for the claim loop: a claim for this slot alone that
            # got its task leaves the worker as it was.
            if self._locked:             # for the free slots too (alone, it says nothing of a backlog)
                w._note_backlog(self._limit, self._free, len(claimed))
            w._count_claim(self._reason, claimed,
                           None if claimed and not self._locked else len(claimed) >= self._free)
            if w._holding():
                return w._next_after_held(claimed, self._at, slots)
            first = w._hold(claimed[0], self._at) if claimed else None
            w._hand_out(claimed[1:], self._at, slots)
            return first
        finally:
            self._release()
            with w._wake_lock:
                w._reports -= 1
                w._reports_done.notify_all()
            w._wake.set()            # the claim loop looks again (it may have left free slots to this report)

    def _release(self) -> None:
        if self._locked:
            self._locked = False
            self._worker._claim_lock.release()
