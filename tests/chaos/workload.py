"""The chaos run's definitions, their inputs, and what each run must end as.

Every definition's outcome follows from its input and from what the driver does to
the run (signals, cancel), never from the faults: a SIGKILLed worker's task comes back
through its lease's expiry, which does not consume the retry policy, and every TASK
allows more expiries (MAX_LEASE_EXPIRIES) than the run's kills can cause; runs that
should fail fail whatever the faults.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

LEASE_S = 3
#: More than the injected failures (at most 2).
GENEROUS = {"max_attempts": 12, "initial_backoff_s": 0.05, "multiplier": 2, "max_backoff_s": 0.5}
#: A worker is killed every 0.5-1.2 s, far more often than in production (the default
#: is 3): a task must survive several of its holders being killed in a row.
MAX_LEASE_EXPIRIES = 12
TIGHT = {"max_attempts": 2, "initial_backoff_s": 0.05, "multiplier": 2, "max_backoff_s": 0.2}


def _task(node_id: str, *, task: str = "work", deps: tuple[str, ...] = (), input: Any = None,
          retry: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    node: dict[str, Any] = {"id": node_id, "type": "TASK", "task": task, "depends_on": list(deps),
                            "input": input if input is not None else {}, "retry": retry or GENEROUS,
                            "lease_s": LEASE_S, "max_lease_expiries": MAX_LEASE_EXPIRIES}
    node.update(extra)
    return node


def _wait_event(node_id: str, event: str, *, deps: tuple[str, ...] = (), timeout_s: float = 600,
                on_timeout: str = "fail") -> dict[str, Any]:
    return {"id": node_id, "type": "WAIT_FOR_SIGNAL", "signal": event, "depends_on": list(deps),
            "timeout_s": timeout_s, "on_timeout": on_timeout}


WORK = {"fail_until": "$.input.fail", "sleep": "$.input.sleep"}

#: id -> (nodes, share of the runs)
DEFINITIONS: dict[str, tuple[list[dict[str, Any]], float]] = {
    "chain": ([
        _task("a", input=WORK),
        _task("b", deps=("a",), input={"sleep": "$.input.sleep"}),
        _task("c", deps=("b",), input={"fail_until": "$.input.fail"}),
    ], 0.25),
    "switch": ([
        _task("tier", task="tier", input={"amount": "$.input.amount"}),
        {"id": "route", "type": "SWITCH", "depends_on": ["tier"], "expression": "$.nodes.tier.output.tier",
         "cases": {"gold": ["express"]}, "default": ["standard"]},
        _task("express", deps=("route",), input=WORK),
        _task("standard", deps=("route",), input=WORK, queue="slow"),
        _task("notify", deps=("express", "standard")),
    ], 0.15),
    "timer": ([
        {"id": "nap", "type": "WAIT", "duration_s": 0.3},
        _task("after", deps=("nap",), input=WORK),
    ], 0.10),
    "signals": ([
        _wait_event("w1", "go"),
        _task("step", input=WORK),
        _wait_event("w2", "go", deps=("step",)),
        _task("end", deps=("w1", "w2"), input={"a": "$.nodes.w1.output", "b": "$.nodes.w2.output"}),
    ], 0.15),
    "optional": ([
        _task("opt", input={"fatal": True}, optional=True),
        _task("main", input=WORK),
        _task("join", deps=("opt", "main")),
    ], 0.08),
    "exhaust": ([
        _task("a", input={"fail_until": 99}, retry=TIGHT),
        _task("b", deps=("a",)),
    ], 0.07),
    "fatal": ([
        _task("a", input={"fatal": True}),
        _task("b", deps=("a",)),
    ], 0.05),
    "timeout_continue": ([
        _wait_event("w", "never", timeout_s=0.5, on_timeout="continue"),
        _task("after", deps=("w",)),
    ], 0.05),
    "timeout_fail": ([
        _wait_event("w", "never", timeout_s=0.5, on_timeout="fail"),
        _task("after", deps=("w",)),
    ], 0.05),
    "held": ([
        _wait_event("w", "release"),
        _task("after", deps=("w",)),
    ], 0.05),
}


def specs(hook_base: str) -> list[dict[str, Any]]:
    """The definitions to deploy, each reporting to ``hook_base/<id>``."""
    return [{"id": wf, "name": f"chaos {wf}", "webhook_url": f"{hook_base}/{wf}", "nodes": nodes}
            for wf, (nodes, _share) in DEFINITIONS.items()]


@dataclass
class Planned:
    """One run the driver will start, and what it must end as."""

    workflow: str
    input: dict[str, Any]
    status: str
    reached: frozenset[str]
    states: dict[str, str] = field(default_factory=dict)   # node -> final state, where it matters
    signals: int = 0            # "go" signals the driver sends
    cancel: bool = False


def plan(rng: random.Random) -> Planned:
    """Draw a definition by its share and an input, with the outcome they imply."""
    names = list(DEFINITIONS)
    wf = rng.choices(names, weights=[DEFINITIONS[n][1] for n in names])[0]
    every = frozenset(n["id"] for n in DEFINITIONS[wf][0])
    work = {"fail": rng.choice([0, 0, 1, 2]), "sleep": rng.choice([0, 0, 0.1, 0.4, 1.2])}
    if wf == "chain":
        return Planned(wf, work, "SUCCEEDED", every, {n: "COMPLETED" for n in every})
    if wf == "switch":
        amount = rng.choice([5, 50, 150, 500])
        gold = amount >= 100
        return Planned(wf, {**work, "amount": amount}, "SUCCEEDED", every,
                       {"express": "COMPLETED" if gold else "SKIPPED", "standard": "SKIPPED" if gold else "COMPLETED",
                        "route": "COMPLETED", "notify": "COMPLETED"})
    if wf == "timer":
        return Planned(wf, work, "SUCCEEDED", every, {"nap": "COMPLETED", "after": "COMPLETED"})
    if wf == "signals":
        return Planned(wf, work, "SUCCEEDED", every, {n: "COMPLETED" for n in every}, signals=2)
    if wf == "optional":
        return Planned(wf, work, "SUCCEEDED", every, {"opt": "FAILED", "main": "COMPLETED", "join": "COMPLETED"})
    if wf == "exhaust":
        return Planned(wf, {}, "FAILED", frozenset({"a"}), {"a": "FAILED"})
    if wf == "fatal":
        return Planned(wf, {}, "FAILED", frozenset({"a"}), {"a": "FAILED"})
    if wf == "timeout_continue":
        return Planned(wf, {}, "SUCCEEDED", every, {"w": "COMPLETED", "after": "COMPLETED"})
    if wf == "timeout_fail":
        return Planned(wf, {}, "FAILED", frozenset({"w"}), {"w": "FAILED"})
    return Planned(wf, {}, "CANCELLED", frozenset({"w"}), {"w": "CANCELLED"}, cancel=True)


def injected_failures(workflow: str, node_id: str, run_input: dict[str, Any]) -> int:
    """How many attempts of a node fail on purpose ("transient failure on attempt n")."""
    if workflow == "exhaust" and node_id == "a":
        return 99
    if (workflow, node_id) in {("chain", "a"), ("chain", "c"), ("switch", "express"), ("switch", "standard"),
                               ("timer", "after"), ("signals", "step"), ("optional", "main")}:
        return int(run_input.get("fail") or 0)
    return 0
