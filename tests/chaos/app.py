"""Handlers the chaos run's worker processes serve (``--app tests.chaos.app:make_worker``).

Behaviour comes from the task input, so the expected outcome of every run follows
from its definition and input alone: ``fail_until`` fails attempts below it,
``fatal`` raises NonRetryableError, ``sleep`` works that long (stopping early when
the lease is lost: the result would be dropped anyway).
"""

from __future__ import annotations

import os
import time
from typing import Any

from composer_ops import Engine, NonRetryableError, TaskContext, Worker


def work(input: Any, ctx: TaskContext) -> dict[str, Any]:
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
    return {"tier": "gold" if amount >= 100 else "basic"}


def make_worker(engine: Engine) -> Worker:
    worker = Worker(engine, queues=["default", "slow"], concurrency=int(os.environ.get("CHAOS_CONCURRENCY", "4")),
                    poll_interval=0.2)
    worker.handler("work")(work)
    worker.handler("tier")(tier)
    return worker
