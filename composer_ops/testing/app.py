"""A worker app whose behaviour comes from each task's input, for end-to-end and smoke
tests: ``composer-ops worker --app composer_ops.testing.app:make_worker``.

Every handler reads ``fatal`` (raise :class:`NonRetryableError`), ``fail_until: n``
(fail attempts below n, retryably) and ``sleep: s`` (stopping early on a lost lease),
and echoes node, attempt, pid and input, so a run's outcome follows from its definition
and input. Tasks: ``work``, ``slow``, ``payments.charge``, ``ship.express``,
``ship.standard``, ``notify``, and ``tier`` (``gold`` for an ``amount`` of 100 or more).
Queues: ``default``, ``payments``, ``slow``.
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
