"""The test suite's worker and coordinator processes: :class:`composer_ops.processes.Fleet`
serving :mod:`composer_ops.testing.app` unless told otherwise, and :func:`wait_for`. ::

    with Fleet(db_url) as fleet:
        fleet.worker(concurrency=2)
        fleet.coordinator()
        run_id = engine.start("wf")
        wait_for(lambda: engine.get_run(run_id).status == "SUCCEEDED", what="the run")
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from composer_ops.core.model import TERMINAL_RUN_STATUSES
from composer_ops.processes import Fleet as _Fleet
from composer_ops.processes import Kill, Kind, Proc

__all__ = ["APP", "TERMINAL", "Fleet", "Kill", "Kind", "Proc", "wait_for"]

APP = "composer_ops.testing.app:make_worker"
#: Run statuses a run ends in (``core.model``'s; the members compare equal to the text).
TERMINAL = TERMINAL_RUN_STATUSES


class Fleet(_Fleet):
    """A :class:`composer_ops.processes.Fleet` whose workers serve :data:`APP` by default."""

    def __init__(self, db_url: str, *, app: str = APP, **options: Any) -> None:
        super().__init__(db_url, app=app, **options)


def wait_for(predicate: Callable[[], Any], timeout: float = 90.0, interval: float = 0.1, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something true, and return that; raise
    AssertionError naming ``what`` after ``timeout`` seconds (by default long enough for
    worker and coordinator processes to start on a loaded machine: it costs nothing when
    the condition comes sooner)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)
