"""composer_ops.ops.investigation without a database: a MAP node's counters against its item rows."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from composer_ops.ops.investigation import ITEM_STATES_SCHEMA, MAP_NODES_SCHEMA, map_disagreements


@pytest.mark.parametrize(("states", "nodes", "expected"), [
    ([("m", "COMPLETED", 2)], [("m", "COMPLETED", 2, 2, 2, 0)], []),
    ([("m", "COMPLETED", 1), ("m", "FAILED", 1)], [("m", "COMPLETED", 2, 2, 2, 0)],
     [("m", "counters say 2 items, 2 done, 0 failed; its item rows: 2 items, 1 COMPLETED, 1 FAILED")]),
    ([("m", "PENDING", 3)], [("m", "FAILED", None, None, None, None)], [("m", "no counters, 3 item rows")]),
    ([("x", "RUNNING", 1)], [], [("x", "1 item rows and no MAP node row")]),
    ([], [("m", "FAILED", None, None, None, None)], []),    # items not a list: no items, no counters
])
def test_map_disagreements(states: list[tuple[Any, ...]], nodes: list[tuple[Any, ...]],
                           expected: list[tuple[str, str]]) -> None:
    frame = pl.DataFrame(states, orient="row", schema=ITEM_STATES_SCHEMA)
    counters = pl.DataFrame(nodes, orient="row", schema=MAP_NODES_SCHEMA)
    assert map_disagreements(counters, frame) == expected
