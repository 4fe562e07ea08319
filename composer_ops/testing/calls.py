"""Counting the Python function calls of a piece of code: the engine's per-event cost
that no load on the machine changes (``tests/integration/test_engine_calls.py``,
``python -m bench.calls``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def count_calls(fn: Callable[[], object]) -> int:
    """The Python function calls ``fn()`` makes in this thread, ``fn`` itself included
    (``sys.setprofile`` 'call' events; builtins and C functions are not counted)."""
    calls = 0

    def profiler(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls
