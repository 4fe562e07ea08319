"""The four workflows the simulator deploys, their inputs and their signal plans.

``order-fulfilment`` (parallel charge and fraud check, a SWITCH on the tier, a carrier
scan awaited without a timeout), ``nightly-batch`` (a fan-out of six shards and a merge),
``expense-approval`` (an approval with a timeout, then a SWITCH) and
``payment-reminder`` (a WAIT ``until`` an instant of the input). Every TASK passes
``$.input.sim`` (the seed and run key) to its handler, which draws its behaviour from it
(:mod:`composer_ops.simulate.model`); durations are multiplied by ``time_scale``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from composer_ops.core.spec import parse_spec
from composer_ops.errors import NotFound

if TYPE_CHECKING:
    from composer_ops.engine import Engine

__all__ = [
    "LEASE_S",
    "QUEUES",
    "WORKFLOW_WEIGHTS",
    "SignalPlan",
    "definitions",
    "deploy_definitions",
    "make_input",
    "plan_cancel",
    "plan_signals",
]

#: Lease of every simulated task: short, so a killed worker's tasks come back quickly.
LEASE_S = 4
#: Every queue the definitions dispatch on; simulated workers serve them all.
QUEUES = ("payments", "risk", "shipping", "default", "batch", "approvals", "billing")
#: Share of runs per workflow (live arrivals and generated months alike).
WORKFLOW_WEIGHTS: Mapping[str, float] = {
    "order-fulfilment": 0.50,
    "expense-approval": 0.20,
    "payment-reminder": 0.22,
    "nightly-batch": 0.08,
}
APPROVAL_TIMEOUT_S = 20.0
BATCH_SHARDS = 6
SIM = "$.input.sim"


def _retry(max_attempts: int, initial: float = 0.5, cap: float = 4.0) -> dict[str, Any]:
    return {"max_attempts": max_attempts, "initial_backoff_s": initial, "multiplier": 2, "max_backoff_s": cap}


def _task(node_id: str, task: str, queue: str, input: dict[str, Any], *, depends_on: list[str] | None = None,
          retry: dict[str, Any] | None = None, optional: bool = False) -> dict[str, Any]:
    node: dict[str, Any] = {"id": node_id, "type": "TASK", "task": task, "queue": queue,
                            "input": {**input, "sim": SIM}, "retry": retry or _retry(3), "lease_s": LEASE_S}
    if depends_on:
        node["depends_on"] = depends_on
    if optional:
        node["optional"] = True
    return node


def _order(scale: float) -> dict[str, Any]:
    customer = {"customer": "$.input.customer"}
    return {
        "id": "order-fulfilment", "name": "Order fulfilment",
        "description": "Charge, ship by tier, wait for the carrier's delivery scan, notify.",
        "config": {"region": "eu"},
        "nodes": [
            _task("charge", "payments.charge", "payments",
                  {"amount": "$.input.amount", "currency": "$.input.currency", **customer}, retry=_retry(4)),
            _task("fraud_check", "risk.score", "risk", {"amount": "$.input.amount", **customer},
                  retry=_retry(2), optional=True),
            {"id": "route", "type": "SWITCH", "depends_on": ["charge", "fraud_check"],
             "expression": "$.nodes.charge.output.tier", "cases": {"gold": ["express"]}, "default": ["standard"]},
            _task("express", "ship.express", "shipping", {"order_id": "$.input.order_id", "region": "$.config.region"},
                  depends_on=["route"]),
            _task("standard", "ship.standard", "shipping",
                  {"order_id": "$.input.order_id", "region": "$.config.region"}, depends_on=["route"]),
            {"id": "cool_off", "type": "WAIT", "depends_on": ["express", "standard"],
             "duration_s": round(2.0 * scale, 3)},
            {"id": "delivered", "type": "WAIT_FOR_SIGNAL", "depends_on": ["cool_off"], "signal": "delivered"},
            _task("notify", "notify.email", "default",
                  {"template": "order-delivered", "proof": "$.nodes.delivered.output", **customer},
                  depends_on=["delivered"], retry=_retry(5)),
        ],
    }


def _batch(scale: float) -> dict[str, Any]:
    shards = [f"shard_{i}" for i in range(BATCH_SHARDS)]
    date = {"date": "$.input.date"}
    return {
        "id": "nightly-batch", "name": "Nightly batch",
        "description": "Extract, transform six shards in parallel, merge, publish.",
        "config": {"warehouse": "analytics"},
        "nodes": [
            _task("extract", "batch.extract", "batch", {**date, "shards": BATCH_SHARDS}),
            *[_task(s, "batch.transform", "batch", {**date, "shard": i, "rows": "$.nodes.extract.output.rows"},
                    depends_on=["extract"], retry=_retry(3, 1.0, 8.0)) for i, s in enumerate(shards)],
            _task("merge", "batch.merge", "batch", date, depends_on=shards),
            _task("publish", "batch.publish", "batch", date, depends_on=["merge"]),
        ],
    }


def _approval(scale: float) -> dict[str, Any]:
    employee = {"employee": "$.input.employee"}
    return {
        "id": "expense-approval", "name": "Expense approval",
        "description": "Submit, wait for the manager's decision (or time out), pay out or reject, archive.",
        "config": {},
        "nodes": [
            _task("submit", "approvals.submit", "approvals",
                  {"amount": "$.input.amount", "category": "$.input.category", **employee}),
            {"id": "manager_approval", "type": "WAIT_FOR_SIGNAL", "depends_on": ["submit"], "signal": "approved",
             "timeout_s": round(APPROVAL_TIMEOUT_S * scale, 3)},
            {"id": "decide", "type": "SWITCH", "depends_on": ["manager_approval"],
             "expression": "$.nodes.manager_approval.output.decision",
             "cases": {"approve": ["payout"]}, "default": ["reject_notice"]},
            _task("payout", "payments.payout", "payments", {"amount": "$.nodes.submit.output.amount", **employee},
                  depends_on=["decide"], retry=_retry(4)),
            _task("reject_notice", "notify.email", "default", {"template": "expense-rejected", **employee},
                  depends_on=["decide"]),
            _task("archive", "approvals.archive", "approvals", {"request": "$.nodes.submit.output.request_id"},
                  depends_on=["payout", "reject_notice"]),
        ],
    }


def _reminder(scale: float) -> dict[str, Any]:
    invoice = {"invoice": "$.nodes.send_invoice.output.invoice"}
    return {
        "id": "payment-reminder", "name": "Payment reminder",
        "description": "Invoice, wait until the due instant, then close it or send a reminder.",
        "config": {},
        "nodes": [
            _task("send_invoice", "billing.invoice", "billing",
                  {"customer": "$.input.customer", "amount": "$.input.amount"}),
            {"id": "wait_due", "type": "WAIT", "depends_on": ["send_invoice"], "until": "$.input.remind_at"},
            _task("check_paid", "billing.check", "billing", invoice, depends_on=["wait_due"]),
            {"id": "paid", "type": "SWITCH", "depends_on": ["check_paid"],
             "expression": "$.nodes.check_paid.output.status", "cases": {"paid": ["close"]},
             "default": ["send_reminder"]},
            _task("send_reminder", "notify.email", "default",
                  {"template": "payment-reminder", "customer": "$.input.customer"}, depends_on=["paid"]),
            _task("close", "billing.close", "billing", invoice, depends_on=["paid"]),
        ],
    }


def definitions(time_scale: float = 1.0) -> list[dict[str, Any]]:
    """The four definition documents, durations multiplied by ``time_scale``."""
    return [_order(time_scale), _batch(time_scale), _approval(time_scale), _reminder(time_scale)]


def deploy_definitions(engine: Engine, time_scale: float = 1.0) -> dict[str, tuple[int, bool]]:
    """Deploy the four definitions; a deployed version whose spec is identical is
    reused rather than re-deployed. Returns ``{workflow_id: (version, newly_deployed)}``."""
    from composer_ops.repo import definitions as repo

    result: dict[str, tuple[int, bool]] = {}
    for doc in definitions(time_scale):
        canonical = parse_spec(doc).to_json()
        with engine.pool.connection() as conn:
            try:
                row = repo.get_deployed(conn, doc["id"])
            except NotFound:
                row = None
        if row is not None and row.enabled and row.deleted_at is None and row.spec_json == canonical:
            result[doc["id"]] = (row.version, False)
            continue
        _, version = engine.deploy(doc, created_by="composer-ops simulate")
        result[doc["id"]] = (version, True)
    return result


# -- per-run plans ---------------------------------------------------------------


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def make_input(rng: random.Random, workflow_id: str, sim: dict[str, Any], now: float, time_scale: float) -> Any:
    """A realistic run input; ``now`` (epoch seconds, database clock) anchors instants."""
    if workflow_id == "order-fulfilment":
        return {"order_id": f"ORD-{rng.randint(1, 9_999_999):07d}", "customer": f"C-{rng.randint(1, 25_000):05d}",
                "amount": round(rng.lognormvariate(math.log(70.0), 0.9), 2),
                "currency": rng.choices(("EUR", "GBP", "USD"), (6, 2, 2))[0], "sim": sim}
    if workflow_id == "nightly-batch":
        return {"date": datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d"), "sim": sim}
    if workflow_id == "expense-approval":
        return {"employee": f"E-{rng.randint(1, 3_000):04d}",
                "amount": round(rng.lognormvariate(math.log(120.0), 0.8), 2),
                "category": rng.choice(("travel", "meals", "equipment", "training")), "sim": sim}
    delay = rng.lognormvariate(math.log(3.0), 0.5) * time_scale
    return {"customer": f"C-{rng.randint(1, 25_000):05d}", "amount": round(rng.uniform(20, 900), 2),
            "remind_at": _iso(now + delay), "sim": sim}


@dataclass(frozen=True, kw_only=True)
class SignalPlan:
    """When a run's signal arrives, relative to the node that waits for it.

    ``early``: ``delay_s`` after the run starts, before the node waits (buffered);
    ``late``: ``delay_s`` after the node starts waiting; ``too_late``: the same, but
    ``delay_s`` is beyond the node's timeout (the run has failed: the signal is
    refused); ``never``: not at all. ``duplicate_after_s``: a second, identical
    signal that long after the first.
    """

    name: str
    timing: str
    delay_s: float
    payload: Any
    duplicate_after_s: float | None = None


def plan_signals(rng: random.Random, workflow_id: str, time_scale: float) -> list[SignalPlan]:
    """The signals a run of ``workflow_id`` will receive."""
    if workflow_id == "order-fulfilment":
        roll = rng.random()
        timing = "early" if roll < 0.05 else "late" if roll < 0.998 else "never"
        delay = 0.05 if timing == "early" else rng.lognormvariate(math.log(1.2), 0.6) * time_scale
        payload = {"scan": f"SCN{rng.getrandbits(32):010d}", "signed_by": rng.choice(("front door", "neighbour"))}
        dup = rng.uniform(0.05, 0.3) if rng.random() < 0.03 else None
        return [SignalPlan(name="delivered", timing=timing, delay_s=delay, payload=payload, duplicate_after_s=dup)]
    if workflow_id == "expense-approval":
        roll = rng.random()
        timing = "early" if roll < 0.15 else "late" if roll < 0.85 else "never" if roll < 0.95 else "too_late"
        timeout = APPROVAL_TIMEOUT_S * time_scale
        if timing == "early":
            delay = 0.05
        elif timing == "late":
            delay = min(rng.lognormvariate(math.log(3.0), 0.7) * time_scale, 0.8 * timeout)
        else:
            delay = timeout + rng.uniform(1.0, 3.0) * time_scale
        payload = {"decision": "approve" if rng.random() < 0.8 else "reject",
                   "by": f"M-{rng.randint(1, 200):03d}"}
        return [SignalPlan(name="approved", timing=timing, delay_s=delay, payload=payload)]
    return []


#: Why simulated runs get cancelled (recorded as the run's error).
CANCEL_REASONS = ("customer changed their mind", "duplicate submission", "operator: wrong input, resubmitted")


def plan_cancel(rng: random.Random, cancel_rate: float, time_scale: float) -> tuple[float, str] | None:
    """Seconds after its start at which the run is cancelled, and why; or None."""
    if rng.random() >= cancel_rate:
        return None
    return rng.uniform(0.3, 8.0) * time_scale, rng.choice(CANCEL_REASONS)
