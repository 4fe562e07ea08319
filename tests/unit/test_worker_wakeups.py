"""What a worker makes of the notifications it hears (engine/worker.py), without a
database: its own channel's totals, an empty payload there, the shared channel's word."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from composer_ops.engine.worker import NOT_TOLD, TOLD_ALL, TOLD_ONE, Worker
from composer_ops.repo.outbox import CHANNEL


def _worker(*, single_server: bool = True) -> Worker:
    engine = SimpleNamespace(claims_count_wakeups=single_server)
    return Worker(cast(Any, engine), queues=["default"], concurrency=4, worker_id="w")


def test_notifications_set_what_the_worker_claims_for() -> None:
    w = _worker()
    w._on_notify(w._wake_channel, "3")
    assert (w._promised, w._told) == (3, NOT_TOLD)
    w._on_notify(w._wake_channel, "2")                 # an older total: ignored
    w._on_notify(w._wake_channel, "garbage")
    w._on_notify(CHANNEL, "other-queue")               # a queue it does not serve
    assert (w._promised, w._told) == (3, NOT_TOLD)
    assert w._take_wakeups(4) == (3, "own", 3, 3, NOT_TOLD)
    w._on_notify(w._wake_channel, "")                  # told of one task, no wake-up handed
    assert w._told == TOLD_ONE
    # One at least: the claim adds the tasks no wake-up covers, up to its room of 4.
    assert w._take_wakeups(4, woken=True) == (1, "shared", 3, 0, TOLD_ONE)
    assert w._take_wakeups(4, woken=True) is None      # nothing left to claim for
    w._on_notify(CHANNEL, "default")                   # the shared channel: all its room
    assert w._take_wakeups(2, woken=True) == (2, "shared", 3, 0, TOLD_ALL)


def test_told_of_one_task_with_wakeups_of_its_own() -> None:
    w = _worker()
    w._on_notify(w._wake_channel, "2")
    w._on_notify(w._wake_channel, "")
    assert w._take_wakeups(4, woken=True) == (2, "shared", 2, 2, TOLD_ONE)


def test_the_shared_word_outranks_one_task() -> None:
    w = _worker()
    w._on_notify(CHANNEL, "default")
    w._on_notify(w._wake_channel, "")                  # does not lower what it was told
    assert w._told == TOLD_ALL
    assert w._take_wakeups(4, woken=True) == (4, "shared", 0, 0, TOLD_ALL)


def test_told_of_one_task_on_citus_claims_all_its_room() -> None:
    """On Citus no claim counts the tasks no wake-up covers: asking for one task would
    leave the rest of a backlog to the poll."""
    w = _worker(single_server=False)
    w._on_notify(w._wake_channel, "")
    assert w._take_wakeups(4, woken=True) == (4, "shared", 0, 0, TOLD_ONE)


@pytest.mark.parametrize("told", [TOLD_ONE, TOLD_ALL])
def test_a_claim_not_made_gives_back_what_it_was_told(told: int) -> None:
    w = _worker()
    w._told = told
    taken = w._take_wakeups(4, woken=True)
    assert taken is not None and w._told == NOT_TOLD
    w._give_back(taken[3], taken[4])
    assert w._told == told
