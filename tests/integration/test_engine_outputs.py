"""An output given to ``Engine.complete`` directly (a worker of the caller's own, not
``Worker``, whose handlers' outputs are checked before they are reported) is held to
the same rule as a run's input: a storable JSON document of at most 8 MiB. Before,
``Engine.complete`` stored an output of any size, and its dependents' inputs with it."""

from __future__ import annotations

from typing import Any

import pytest

from composer_ops import Engine, Invalid
from composer_ops.core.jsonsize import MAX_BYTES

TWO = {"id": "two-steps", "nodes": [{"id": "first", "type": "TASK", "task": "first"},
                                   {"id": "second", "type": "TASK", "task": "second", "depends_on": ["first"],
                                    "input": {"got": "$.nodes.first.output"}}]}


@pytest.mark.parametrize(("output", "why"), [
    ("x" * MAX_BYTES, rf"output is more than {MAX_BYTES} bytes of JSON \(at \$\); the limit is {MAX_BYTES}"),
    ({"when": {1, 2}}, r"output is not JSON: set at \$\.when"),
    ({"n": float("nan")}, r"output has a non-finite number at \$\.n"),
])
def test_an_output_that_is_no_storable_json_is_refused_and_changes_nothing(engine: Engine, output: Any,
                                                                          why: str) -> None:
    engine.deploy(TWO)
    run_id = engine.start("two-steps")
    (claim,) = engine.claim(["default"], "w1", 1)
    with pytest.raises(Invalid, match=why):
        engine.complete(claim, output)
    run = engine.get_run(run_id)
    assert [(t.node_id, t.state) for t in run.tasks] == [("first", "RUNNING")]
    assert engine.complete(claim, {"ok": True}).stale is None          # the attempt is still the one to report
    (second,) = engine.claim(["default"], "w1", 1)
    assert second.input == {"got": {"ok": True}}
