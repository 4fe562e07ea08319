"""The fault sweep's cases of a worker's registration as a waiter
(tests/faults/test_write_paths.py): registering its freed room, unregistering as it
stops, and the coordinator's pass that forgets the registrations of workers gone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_ops.errors import Unavailable
from composer_ops.repo import outbox
from composer_ops.testing.processes import wait_for
from tests.faults.cases import Rig, _handed_out, _idle_waiter, _raised, _unexpected
from tests.faults.harness import Result


def _registration(b: Rig, worker: str) -> tuple[Any, ...] | None:
    """``worker``'s row of task_waiters (channel, queues, slots, promised, seen), if any."""
    rows = b.sql("SELECT channel, queues, slots, promised, seen FROM task_waiters WHERE worker = %s", (worker,))
    return rows[0] if rows else None


def _registered_once(b: Rig, worker: str, result: Result) -> list[str]:
    """A worker's registration of its freed room, retried after a lost acknowledgement,
    is its one row as asked: two free slots, no wake-up handed or taken up."""
    row = _registration(b, worker)
    want = (outbox.wake_channel(worker), ["fw"], 2, 0, 0)
    return _raised(result) + ([] if row == want else [f"registration {row}, expected {want}"])


@dataclass
class HandedWaiter:
    worker: str
    run_id: str


def _handed_waiter(b: Rig) -> HandedWaiter:
    """An idle worker registered on queue fw and handed the wake-up of an f-waited run's
    first task, which it has not taken up."""
    worker = _idle_waiter(b)
    run_id = b.direct.start("f-waited")
    assert _handed_out(b, worker) == 1
    return HandedWaiter(worker=worker, run_id=run_id)


def _stop_worker(b: Rig, s: HandedWaiter) -> bool | None:
    """What a stopping Worker sends: its unregistration (one attempt, engine/worker.py
    ``_unregister``: a connection lost is logged, not retried), then the registry's stop,
    which unregisters too. Returns what the unregistration said (True: the wake-up it was
    handed and had not taken up was passed on), None when it was cut."""
    try:
        told: bool | None = b.engine.unregister_idle(s.worker, seen=0, told=False)
    except Unavailable:
        told = None
    b.engine.worker_stopped(s.worker)
    return told


def _unregistered_task_kept(b: Rig, s: HandedWaiter, result: Result) -> list[str]:
    """Whatever the fault, a stopped worker's registration is gone (no dispatch hands it
    a wake-up it will not act on), an unregistration that was answered passed its
    wake-up on, and the task it was woken for still waits in the outbox."""
    problems = _raised(result) + _unexpected(b, s.run_id, tasks={"a": ("PENDING", 0)}, outbox=[("a", 0)])
    if result.error is None and result.value is False:
        problems.append("the unregistration passed on nothing, with a wake-up not taken up")
    row = _registration(b, s.worker)
    return problems + ([] if row is None else [f"the stopped worker is still registered: {row}"])


@dataclass
class Waiters:
    dead: str
    fresh: str
    live: str


def _dead_and_live_waiters(b: Rig) -> Waiters:
    """Three idle workers registered on queue fw: one unrefreshed for two minutes (past
    outbox.DEAD_WAITER_GRACE_S) and not in the workers registry (gone); one just
    registered, not in the registry yet; one unrefreshed as long but live in the registry."""
    dead = _idle_waiter(b)
    fresh = _idle_waiter(b, cancel=False)
    live = _idle_waiter(b, cancel=False)
    b.direct.register_worker(live, host="test", pid=1, queues=["fw"], concurrency=1, heartbeat_s=30)
    b.sql("UPDATE task_waiters SET since = now() - interval '2 minutes' WHERE worker = ANY(%s)", ([dead, live],))
    return Waiters(dead=dead, fresh=fresh, live=live)


def _waiters_pass_again(b: Rig, s: Waiters) -> None:
    """The next passes, until the dead worker's registration is gone (30 s at most): a
    pass cut short logs its failure and leaves it, and the cut session may hold its row
    a while (the pass skips a locked row)."""
    def forgotten() -> bool:
        if _registration(b, s.dead) is None:
            return True
        b.direct.coordinator().run_once(["leases"])
        return False
    wait_for(forgotten, timeout=30, what="the dead worker's registration gone")


def _dead_forgotten_live_kept(b: Rig, s: Waiters, result: Result) -> list[str]:
    """A pass that reported no failure forgot the dead worker itself; whatever the fault,
    the dead worker's registration is gone once passes run, and the other two are kept
    as they were."""
    problems = _raised(result)
    if result.error is None and not result.value.errors and result.value.waiters_forgotten != 1:
        problems.append(f"a pass without failures forgot {result.value.waiters_forgotten} registrations, not 1")
    if _registration(b, s.dead) is not None:
        problems.append("the dead worker's registration is still there")
    for worker in (s.fresh, s.live):
        row = _registration(b, worker)
        if row is None or row[2:] != (1, 0, 0):
            problems.append(f"{worker}'s registration is {row}, expected 1 slot, no wake-ups")
    return problems
