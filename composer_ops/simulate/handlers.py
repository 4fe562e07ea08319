"""The simulator's worker: ``composer-ops worker --app composer_ops.simulate.handlers:make_worker``.

Each handler draws its attempt from the behaviour model, seeded by the task input's
``sim`` object, the node and the attempt (and, in a run an operator retried, the retry
count), so one seed replays the same behaviour on any worker. Configured through the
environment: ``COMPOSER_SIM_TRANSIENT_RATE`` / ``_PERMANENT_RATE`` / ``_TIME_SCALE``,
``COMPOSER_SIM_WORKER_NAME`` (the lease owner prefix), ``COMPOSER_WORKER_CONCURRENCY``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from composer_ops.engine import Engine, TaskContext, Worker
from composer_ops.repo import history
from composer_ops.simulate.definitions import QUEUES
from composer_ops.simulate.model import PROFILES, Behaviour, attempt_rng, draw_attempt, raise_failure, task_output

__all__ = ["make_handler", "make_worker"]

#: How often a sleeping handler checks whether its lease was lost.
_TICK_S = 0.25


def make_handler(behaviour: Behaviour, task: str,
                 retries: Callable[[str], int] | None = None) -> Callable[[Any, TaskContext], Any]:
    """The handler of ``task``: sleep the drawn duration, then fail or return its output.
    ``retries(run_id)``: how many times the run was retried (none when not given)."""

    def handle(input: Any, ctx: TaskContext) -> Any:
        sim = input.get("sim") if isinstance(input, dict) else None
        sim = sim if isinstance(sim, dict) else {}
        key = (int(sim.get("seed", 0)), str(sim.get("run", ctx.run_id)), ctx.node_id, ctx.attempt)
        rng = attempt_rng(*key)
        draw = draw_attempt(rng, behaviour, task)
        # Only a failure can differ after a retry: the run's retry count is read (one query)
        # for the few attempts drawn to fail, not for every attempt.
        again = retries(ctx.run_id) if retries is not None and draw.outcome != "ok" else 0
        if again:
            rng = attempt_rng(*key, again)
            draw = draw_attempt(rng, behaviour, task)
        deadline = time.monotonic() + draw.duration_s
        while not ctx.lease_lost:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, _TICK_S))
        raise_failure(draw)
        return task_output(task, input, rng)

    handle.__name__ = f"sim_{task.replace('.', '_')}"
    return handle


def make_worker(engine: Engine) -> Worker:
    """A Worker serving every simulated queue, with a handler per task name."""
    behaviour = Behaviour.from_env()
    name = os.environ.get("COMPOSER_SIM_WORKER_NAME", "sim-worker")
    concurrency = int(os.environ.get("COMPOSER_WORKER_CONCURRENCY", "8"))
    worker = Worker(engine, queues=list(QUEUES), concurrency=concurrency, poll_interval=0.5,
                    worker_id=f"{name}:{os.getpid()}")

    def retries(run_id: str) -> int:
        with engine.pool.connection() as conn:
            return history.retries(conn, run_id)

    for task in PROFILES:
        worker.handler(task)(make_handler(behaviour, task, retries))
    return worker
