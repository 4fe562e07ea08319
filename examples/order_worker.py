"""Handlers for examples/order_fulfilment.json.

Run with:  composer-ops worker --app examples.order_worker:make_worker
"""

from __future__ import annotations

from typing import Any

from composer_ops import Engine, NonRetryableError, TaskContext, Worker


def make_worker(engine: Engine) -> Worker:
    worker = Worker(engine, queues=["payments", "default"], concurrency=4)

    @worker.handler("payments.charge")
    def charge(input: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        amount = input.get("amount")
        if not isinstance(amount, int | float) or amount <= 0:
            raise NonRetryableError(f"cannot charge {amount!r}")   # no point retrying bad input
        return {"charged": amount, "region": input["region"], "tier": "gold" if amount >= 100 else "basic"}

    @worker.handler("ship.express")
    def express(input: Any, ctx: TaskContext) -> dict[str, Any]:
        return {"carrier": "courier", "run": ctx.run_id}

    @worker.handler("ship.standard")
    def standard(input: Any, ctx: TaskContext) -> dict[str, Any]:
        return {"carrier": "post", "run": ctx.run_id}

    @worker.handler("notify")
    def notify(input: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        return {"notified": True, "proof": input.get("proof")}

    return worker
