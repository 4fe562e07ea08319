"""When a worker claims ahead (``prefetch``, :meth:`Worker._ahead`): only while its
handlers are short and its last claim got all it asked for; and how far
(:meth:`Worker._claim_ahead`). Pure: no database, no threads."""

from __future__ import annotations

import time
from typing import Any, cast

from composer_ops import TaskContext, Worker
from composer_ops.engine.worker import SHORT_HANDLER_S


def _worker(prefetch: int, concurrency: int = 2) -> Worker:
    w = Worker(cast(Any, None), queues=["default"], concurrency=concurrency, worker_id="w", prefetch=prefetch)
    w._durations.extend([0.01] * (w._durations.maxlen or 0))     # warmed up with short handlers
    w._backlog = True
    return w


def _context(w: Worker, task: str, started: float | None) -> TaskContext:
    ctx = TaskContext(run_id="r", node_id="n", task_id=task, attempt=0, task="t", _worker=w,
                      _claim=cast(Any, None))
    ctx._started = started
    w._active[ctx.key] = ctx
    return ctx


def test_no_prefetch_never_claims_ahead() -> None:
    assert _worker(0)._ahead() == 0


def test_short_handlers_and_a_backlog_claim_ahead() -> None:
    assert _worker(3)._ahead() == 3


def test_a_claim_that_came_back_short_stops_the_claims_ahead() -> None:
    w = _worker(3)
    w._backlog = False
    assert w._ahead() == 0


def test_until_warmed_up_no_claim_is_ahead() -> None:
    w = _worker(3)
    w._durations.pop()
    assert w._ahead() == 0


def test_a_recent_long_handler_stops_the_claims_ahead() -> None:
    w = _worker(3)
    w._durations.append(SHORT_HANDLER_S + 0.01)
    assert w._ahead() == 0


def test_a_handler_running_long_stops_them_but_not_one_reporting_or_held() -> None:
    w = _worker(3)
    long_ago = time.monotonic() - SHORT_HANDLER_S - 1
    _context(w, "held", None)
    assert w._ahead() == 3
    running = _context(w, "running", long_ago)
    assert w._ahead() == 0
    running._reporting = True            # its handler is done: its report is under way
    assert w._ahead() == 3


def test_claims_ahead_fill_up_to_concurrency_plus_prefetch() -> None:
    w = _worker(3, concurrency=2)
    w._inflight = 4
    assert w._claim_ahead(0) == 2 + 3 - 4
    assert w._claim_ahead(1) == 2 + 3 - 3          # a reporting slot takes the next
    w._backlog = False
    assert w._claim_ahead(0) == 0


def test_only_a_claim_for_every_free_slot_or_more_tells_of_a_backlog() -> None:
    w = _worker(3)
    w._note_backlog(limit=1, free=2, got=0)        # asked for its wake-ups only: says nothing
    assert w._backlog
    w._note_backlog(limit=5, free=2, got=4)        # asked ahead, came back short: no backlog
    assert not w._backlog
    w._note_backlog(limit=1, free=2, got=1)
    assert not w._backlog
    w._note_backlog(limit=2, free=2, got=2)        # every free slot filled: tasks may be left
    assert w._backlog
