"""One attempt of a task in a :class:`~composer_ops.engine.worker.Worker`: what its
handler is given (:class:`TaskContext`) and how it ended (:class:`Result`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from composer_ops.engine.jsonvalues import storable_text
from composer_ops.repo.rows import Claim

if TYPE_CHECKING:
    from composer_ops.engine.worker import Worker

__all__ = ["AttemptKey", "Result", "TaskContext", "abandoned_at_shutdown", "describe"]

#: One execution attempt of a task: (task id, attempt number).
AttemptKey = tuple[str, int]


@dataclass
class TaskContext:
    """What a handler knows about the attempt it runs: ``ctx.heartbeat()`` extends
    the lease now (long handlers between natural checkpoints); ``ctx.lease_lost``
    turns true when the lease is gone (cancelled, re-queued, taken over) or can no
    longer be known to be held (heartbeats failed for a whole lease). Once it is
    true the result will be dropped, so a long handler should poll it and stop."""

    run_id: str
    node_id: str
    task_id: str
    attempt: int
    task: str
    _worker: Worker = field(repr=False)
    _claim: Claim = field(repr=False)
    #: monotonic instant until which the lease is surely held: lease_s after the start
    #: of the claim or of the last heartbeat that extended it (the database's expiry
    #: is later, counted from inside those statements).
    _held_until: float = field(default=math.inf, repr=False)
    _lost: bool = field(default=False, repr=False)
    #: why the lease is lost, for the run's history
    _loss: str = field(default="", repr=False)
    _reporting: bool = field(default=False, repr=False)
    #: set when a shutdown gave up waiting for the handler: no more heartbeats (one
    #: still waiting for a slot is never started)
    _abandoned: bool = field(default=False, repr=False)
    #: monotonic instant its handler began; None while it waits for a slot (held)
    _started: float | None = field(default=None, repr=False)

    @property
    def key(self) -> AttemptKey:
        return (self.task_id, self.attempt)

    @property
    def lease_lost(self) -> bool:
        if not self._lost and time.monotonic() >= self._held_until:
            self._lost = True
            self._loss = "heartbeats failed for a whole lease: the lease can no longer be known to be held"
        return self._lost

    def heartbeat(self) -> bool:
        """Extend the lease; False when it is lost (stop working: the result is stale)."""
        return self._worker._beat(self)


@dataclass(frozen=True)
class Result:
    """How one attempt ended, for callers that count (the simulator, tests)."""

    claim: Claim
    status: str          # "completed" | "failed" | "stale"
    detail: str = ""


def describe(exc: BaseException) -> str:
    """An exception as an attempt's error (a handler's, a webhook POST's): its type, and
    its message if any, as the database can store it (:func:`storable_text`). Never
    raises: an exception whose ``str()`` raises is described by its type and that."""
    name = type(exc).__name__
    try:
        text = str(exc).strip()
    except Exception as inner:     # a broken __str__: the attempt's failure is still recorded
        text = f"(its message could not be read: str() raised {type(inner).__name__})"
    text = storable_text(text)
    return f"{name}: {text}" if text else name


def abandoned_at_shutdown(worker_id: str, timeout: float | None, abandoned: Sequence[TaskContext]) -> str:
    """What a worker whose shutdown gave up after ``timeout`` seconds says of the
    attempts it abandoned: the handlers still running keep their leases until they
    lapse; the tasks held for a slot never started and gave theirs up."""
    names = ", ".join(f"task {c.task_id} attempt {c.attempt} (run {c.run_id}, node {c.node_id})" for c in abandoned)
    held = sum(c._started is None for c in abandoned)
    waiting = f" and {held} task(s) held for a slot" if held else ""
    then = ["the running ones' leases are no longer extended, so they are retried once their leases lapse"
            ] if len(abandoned) > held else []
    if held:
        then.append("the held ones never started, and their leases were ended for the sweeper's next pass")
    return (f"worker {worker_id} stopped with {len(abandoned) - held} handler(s) still running{waiting} "
            f"after {timeout or 0:g}s; abandoned {names}: {'; '.join(then)}")
