"""Handlers for examples/charge_all.json (a MAP) and examples/returns.json with its
child workflow examples/refund.json (a SUB_WORKFLOW).

Run with:  composer-ops worker --app examples.fanout_worker:make_worker
"""

from __future__ import annotations

from typing import Any

from composer_ops import Engine, NonRetryableError, TaskContext, Worker


def make_worker(engine: Engine) -> Worker:
    worker = Worker(engine, queues=["payments", "default"], concurrency=8)

    @worker.handler("invoices.list_due")
    def list_due(input: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        invoices = [{"id": f"inv-{i}", "amount": 10 + i} for i in range(20)]
        if input.get("bad"):
            invoices[3]["amount"] = 0           # cannot be charged: that item fails, the MAP goes on
        return {"invoices": invoices}

    @worker.handler("invoices.charge")
    def charge(input: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        # A MAP item's input: the node's "input" with "item" (the list element) and
        # "index" (its position) added.
        invoice = input["item"]
        if invoice["amount"] <= 0:
            raise NonRetryableError(f"invoice {invoice['id']} has nothing to charge")
        return {"invoice": invoice["id"], "charged": invoice["amount"], "region": input["region"]}

    @worker.handler("invoices.summarise")
    def summarise(input: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        charges = input["charges"]          # item outputs in item order; null for a failed item
        return {"charged": sum(c["charged"] for c in charges if c), "failed": charges.count(None)}

    @worker.handler("returns.inspect")
    def inspect(input: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        return {"order": input["order"], "refundable": 25}

    @worker.handler("refunds.pay")
    def pay(input: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        return {"order": input["order"], "refunded": input["amount"]}

    @worker.handler("notify")
    def notify(input: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        return {"notified": True, "proof": input.get("proof")}

    return worker
