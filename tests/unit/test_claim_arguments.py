"""A claim's arguments are checked before any round trip (Engine.next_claim, Worker):
one string where a list of names is taken would otherwise be read as its characters
("default" as the queues d, e, f, a, u, l, t)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from composer_ops import Engine, Worker
from composer_ops.errors import Invalid


def _engine() -> Engine:
    return Engine.__new__(Engine)       # next_claim reads nothing of the engine


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"queues": "default"}, "claim queues must be a list of strings, not one string: got 'default'"),
    ({"task_names": "noop"}, "claim task_names must be a list of strings, not one string: got 'noop'"),
    ({"busy": "0190c0de"}, "claim busy must be a list of strings, not one string: got '0190c0de'"),
    ({"queues": b"default"}, "claim queues must be a list of strings, not one string"),
    ({"limit": 0}, "claim limit must be an integer of at least 1, got 0"),
    ({"room": True}, "claim room must be an integer of at least 1, got True"),
])
def test_a_claim_with_a_bad_argument_is_refused(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"queues": ["default"], "owner": "w", "limit": 1, **kwargs}
    with pytest.raises(Invalid) as info:
        _engine().next_claim(**args)
    assert message in str(info.value)


def test_a_claim_with_lists_keeps_them_as_they_are() -> None:
    ask = _engine().next_claim(["default", "bulk"], "w", 2, ["noop"], room=4, busy=["r1"])
    assert (ask.queues, ask.task_names, ask.busy) == (("default", "bulk"), ("noop",), ("r1",))
    assert (ask.limit, ask.room) == (2, 4)


@pytest.mark.parametrize("queues", ["default", b"default", [], [""], ["default", 3]])
def test_a_worker_takes_a_list_of_queue_names_only(queues: Any) -> None:
    with pytest.raises(Invalid, match="queues must be a non-empty list of queue names"):
        Worker(cast(Any, None), queues=queues)


def test_the_registrations_take_a_list_of_queue_names_only() -> None:
    with pytest.raises(Invalid, match="register_idle queues must be a list of strings"):
        _engine().register_idle("default", "w", None, wake="c", room=1, seen=0)
    with pytest.raises(Invalid, match="register_idle task_names must be a list of strings"):
        _engine().register_idle(["default"], "w", "noop", wake="c", room=1, seen=0)
    with pytest.raises(Invalid, match="register_worker queues must be a list of strings"):
        _engine().register_worker("w", host="h", pid=1, queues="default", concurrency=1, heartbeat_s=1.0)
