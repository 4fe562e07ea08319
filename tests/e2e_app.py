"""Handlers the end-to-end tests run in real worker processes.

Behaviour comes from the task input, so one app serves every scenario:
``{"sleep": s}`` sleeps, ``{"fail_until": n}`` fails attempts below n,
``{"fatal": true}`` raises NonRetryableError; outputs echo what happened.
"""

from __future__ import annotations

import os
import time
from typing import Any

from composer_ops import Engine, NonRetryableError, TaskContext, Worker


def _behave(input: Any, ctx: TaskContext) -> dict[str, Any]:
    spec = input if isinstance(input, dict) else {}
    if spec.get("fatal"):
        raise NonRetryableError("fatal by request")
    if ctx.attempt < int(spec.get("fail_until", 0)):
        raise RuntimeError(f"transient failure on attempt {ctx.attempt}")
    deadline = time.monotonic() + float(spec.get("sleep", 0))
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return {"node": ctx.node_id, "attempt": ctx.attempt, "pid": os.getpid(), "input": spec}


def make_worker(engine: Engine) -> Worker:
    worker = Worker(engine, queues=["default", "payments", "slow"],
                    concurrency=int(os.environ.get("E2E_CONCURRENCY", "4")), poll_interval=0.2)
    for name in ("work", "payments.charge", "ship.express", "ship.standard", "notify", "slow"):
        worker.handler(name)(_behave)

    @worker.handler("tier")
    def tier(input: Any, ctx: TaskContext) -> dict[str, Any]:
        return {"tier": "gold" if input.get("amount", 0) >= 100 else "basic"}

    return worker
