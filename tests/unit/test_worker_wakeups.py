"""A worker's account of what it was woken for (engine/worker.py), without a database:
the notifications it hears and what each claim then asks for."""

from __future__ import annotations

from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from composer_ops.engine.worker import NOT_TOLD, TOLD_ALL, TOLD_ONE, Worker
from composer_ops.repo.outbox import CHANNEL


def _worker() -> Worker:
    return Worker(cast(Any, None), queues=["default"], concurrency=4, worker_id="w")


def test_notifications_set_what_the_worker_was_told() -> None:
    w = _worker()
    w._on_notify(w._wake_channel, "3")
    assert (w._promised, w._told) == (3, NOT_TOLD)
    w._on_notify(w._wake_channel, "2")                 # an older total: ignored
    assert w._promised == 3
    w._on_notify(w._wake_channel, "")                  # told, no wake-up handed
    assert w._told == TOLD_ONE
    w._on_notify(CHANNEL, "other-queue")               # a queue it does not serve
    assert w._told == TOLD_ONE
    w._on_notify(CHANNEL, "default")
    assert w._told == TOLD_ALL
    w._on_notify(w._wake_channel, "")                  # never lowers the shared word
    assert w._told == TOLD_ALL
    w._on_notify(w._wake_channel, "garbage")
    assert (w._promised, w._told) == (3, TOLD_ALL)


def test_told_one_is_one_task_more_and_kept_without_a_slot_for_it() -> None:
    w = _worker()
    w._on_notify(w._wake_channel, "1")
    w._on_notify(w._wake_channel, "")
    assert w._take_wakeups(1, woken=True) == (1, "own", 1, 1, NOT_TOLD)     # a report's one slot
    assert w._told == TOLD_ONE                                             # still owed
    assert w._take_wakeups(3, woken=True) == (1, "told", 1, 0, TOLD_ONE)
    assert w._told == NOT_TOLD
    assert w._take_wakeups(1, woken=True) is None                          # nothing left
    w._give_back(0, TOLD_ONE)                                              # that claim was not made
    assert w._told == TOLD_ONE


@given(st.lists(st.one_of(st.integers(0, 20).map(str), st.just(""), st.just("default")), max_size=12),
       st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_a_claim_never_asks_for_more_than_its_slots_and_loses_no_told_task(
        payloads: list[str], frees: list[int]) -> None:
    w = _worker()
    for payload in payloads:
        w._on_notify(CHANNEL if payload == "default" else w._wake_channel, payload)
    for free in frees:
        before = (w._promised - w._taken, w._told)
        taken = w._take_wakeups(free)
        assert taken is not None
        limit, reason, seen, own, told = taken
        assert 1 <= limit <= free
        assert own == min(free, before[0]) and seen == w._taken <= w._promised
        # A told task is claimed now (the limit has room for it) or stays owed.
        if before[1] == TOLD_ONE:
            assert (told == TOLD_ONE and limit == own + 1) or (told == NOT_TOLD and w._told == TOLD_ONE)
        assert reason in ("own", "told", "shared", "room")
