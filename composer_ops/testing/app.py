"""A worker app whose behaviour comes from each task's input, for end-to-end tests
and smoke tests of a deployment: ``composer-ops worker --app composer_ops.testing.app:make_worker``.

Every handler reads the same keys of its input (absent or null means 0 / false):
``fatal`` raises :class:`NonRetryableError`; ``fail_until: n`` fails attempts below
``n`` with a retryable error; ``sleep: s`` works that long, stopping early when the
lease is lost (its result would be dropped as stale anyway). The output echoes what
happened: node, attempt, the worker's pid and the input. So the expected outcome of a
run follows from its definition and input alone.

Tasks served: ``work``, ``slow``, ``payments.charge``, ``ship.express``,
``ship.standard`` and ``notify`` behave as above; ``tier`` returns
``{"tier": "gold"}`` for an ``amount`` of 100 or more, else ``"basic"`` (the example
order workflow's SWITCH reads it). Queues: ``default``, ``payments``, ``slow``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from composer_ops import Engine, NonRetryableError, TaskContext, Worker

QUEUES = ("default", "payments", "slow")
BEHAVING_TASKS = ("work", "slow", "payments.charge", "ship.express", "ship.standard", "notify")


def behave(input: Any, ctx: TaskContext) -> dict[str, Any]:
    """Fail, sleep or succeed as the input says; see the module's docstring."""
    spec = input if isinstance(input, dict) else {}
    if spec.get("fatal"):
        raise NonRetryableError("fatal by request")
    if ctx.attempt < int(spec.get("fail_until") or 0):
        raise RuntimeError(f"transient failure on attempt {ctx.attempt}")
    deadline = time.monotonic() + float(spec.get("sleep") or 0)
    while time.monotonic() < deadline and not ctx.lease_lost:
        time.sleep(0.02)
    return {"node": ctx.node_id, "attempt": ctx.attempt, "pid": os.getpid(), "input": spec}


def tier(input: Any, ctx: TaskContext) -> dict[str, Any]:
    amount = input.get("amount", 0) if isinstance(input, dict) else 0
    return {"tier": "gold" if (amount or 0) >= 100 else "basic"}


def make_worker(engine: Engine) -> Worker:
    """The Worker ``composer-ops worker --app composer_ops.testing.app:make_worker`` runs
    (concurrency 4 unless ``--concurrency`` says otherwise)."""
    worker = Worker(engine, queues=list(QUEUES), concurrency=4, poll_interval=0.2)
    for name in BEHAVING_TASKS:
        worker.handler(name)(behave)
    worker.handler("tier")(tier)
    return worker
