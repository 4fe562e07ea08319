"""The simulator's handlers (``composer_ops.simulate.handlers``): an attempt draws the
same behaviour for the same seed, run, node and attempt, and an operator's retry of the
run draws afresh, so a retried demo run can succeed instead of failing the same way."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from composer_ops.simulate.handlers import make_handler
from composer_ops.simulate.model import PROFILES, Behaviour

TASK = next(iter(PROFILES))
INPUT = {"sim": {"seed": 7, "run": "run-key"}}


def _outcome(retry: int, node: str, retries_known: bool = True) -> str:
    behaviour = Behaviour(transient_rate=0.0, permanent_rate=0.2, crash_rate=0.0, time_scale=0.01)
    handler = make_handler(behaviour, TASK, (lambda run_id: retry) if retries_known else None)
    ctx: Any = SimpleNamespace(run_id="r", node_id=node, attempt=0, lease_lost=False)
    try:
        handler(INPUT, ctx)
    except Exception as exc:                 # the drawn failure: its type and message are the outcome
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_a_retry_draws_afresh_and_the_same_generation_draws_the_same() -> None:
    nodes = [f"n{i}" for i in range(12)]
    failing = [n for n in nodes if _outcome(0, n) != "ok"]
    assert failing, "no node failed: the draw ignores the rate"
    for node in failing:
        assert _outcome(0, node) == _outcome(0, node)                  # reproducible within a generation
        # Some later generation succeeds where generation 0 failed (about a 0.6 chance each).
        assert any(_outcome(retry, node) == "ok" for retry in range(1, 12)), node
    # Without a retry count (or before any retry), the draw is the one the seed always gave.
    assert [_outcome(0, n, retries_known=False) for n in nodes] == [_outcome(0, n) for n in nodes]
