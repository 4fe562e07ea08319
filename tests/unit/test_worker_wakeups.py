"""What a worker makes of the notifications it hears (engine/worker.py), without a
database: its own channel's totals, an empty payload there, the shared channel's word."""

from __future__ import annotations

import queue
from typing import Any, cast

from composer_ops.engine.report_claim import ReportClaim
from composer_ops.engine.worker import Worker
from composer_ops.repo.outbox import CHANNEL


def _worker() -> Worker:
    return Worker(cast(Any, None), queues=["default"], concurrency=4, worker_id="w")


def test_notifications_set_what_the_worker_claims_for() -> None:
    w = _worker()
    w._on_notify(w._wake_channel, "3")
    assert (w._promised, w._told_all) == (3, False)
    w._on_notify(w._wake_channel, "2")                 # an older total: ignored
    w._on_notify(w._wake_channel, "garbage")
    w._on_notify(CHANNEL, "other-queue")               # a queue it does not serve
    assert (w._promised, w._told_all) == (3, False)
    assert w._take_wakeups(4) == (3, "own", 3, 3, False)
    w._on_notify(w._wake_channel, "")                  # told, no wake-up handed: all its room
    assert w._told_all
    assert w._take_wakeups(4, woken=True) == (4, "shared", 3, 0, True)
    assert w._take_wakeups(4, woken=True) is None      # nothing left to claim for
    w._on_notify(CHANNEL, "default")
    assert w._take_wakeups(2, woken=True) == (2, "shared", 3, 0, True)


class _Recorder:
    """An engine that records the claims asked of it and makes none."""

    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []

    def next_claim(self, *args: Any, **kwargs: Any) -> object:
        self.asked.append(kwargs)
        return object()


def test_a_reports_claim_says_it_was_woken() -> None:
    """A report claims only for a worker woken for tasks, so its claim says so: it
    leaves tasks handed to other workers to them (sql/R__claim.sql, p_woken)."""
    engine = _Recorder()
    w = Worker(cast(Any, engine), queues=["default"], concurrency=4, worker_id="w")
    w._on_notify(w._wake_channel, "1")
    then = ReportClaim(w, ("t", 0))
    assert then.ask() is not None
    assert [a["woken"] for a in engine.asked] == [True]
    then.finish(None, queue.SimpleQueue())
    assert (w._promised, w._taken) == (1, 0)            # the claim not made gives its wake-up back
