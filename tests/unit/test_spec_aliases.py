"""The spellings of 0.1.0 keep working: a WAIT_FOR_EVENT node with an "event" key is a
WAIT_FOR_SIGNAL node with a "signal" key, parsed, stored and run alike (SPEC's examples
use the old spelling)."""

from __future__ import annotations

from typing import Any

import pytest

from composer_ops.core.model import NodeType
from composer_ops.core.spec import parse_spec, spec_from_json
from composer_ops.errors import Invalid


def _doc(node: dict[str, Any]) -> dict[str, Any]:
    return {"id": "wf", "nodes": [{"id": "a", "type": "TASK", "task": "t"}, {**node, "depends_on": ["a"]}]}


OLD = {"id": "w", "type": "WAIT_FOR_EVENT", "event": "delivered", "timeout_s": 60}
NEW = {"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "delivered", "timeout_s": 60}
MIXED = [
    {"id": "w", "type": "WAIT_FOR_EVENT", "signal": "delivered", "timeout_s": 60},
    {"id": "w", "type": "WAIT_FOR_SIGNAL", "event": "delivered", "timeout_s": 60},
]


@pytest.mark.parametrize("node", [OLD, NEW, *MIXED], ids=["old", "new", "old type", "old key"])
def test_both_spellings_parse_to_one_node(node: dict[str, Any]) -> None:
    spec = parse_spec(_doc(node))
    assert spec == parse_spec(_doc(NEW))
    w = spec.nodes["w"]
    assert (w.type, w.signal_name, w.timeout_s) == (NodeType.WAIT_FOR_SIGNAL, "delivered", 60)


def test_the_stored_document_has_the_new_spelling_and_parses_back() -> None:
    doc = parse_spec(_doc(OLD)).to_json()
    stored = doc["nodes"][1]
    assert stored["type"] == "WAIT_FOR_SIGNAL" and stored["signal"] == "delivered" and "event" not in stored
    assert spec_from_json(doc) == parse_spec(_doc(OLD))


def test_a_definition_stored_by_0_1_0_still_loads() -> None:
    """0.1.0 stored the old spelling in workflow_definitions.spec_json."""
    assert spec_from_json(_doc({**OLD, "optional": False, "on_timeout": "fail"})).nodes["w"].signal_name == "delivered"


@pytest.mark.parametrize("type_", ["WAIT_FOR_EVENT", "WAIT_FOR_SIGNAL"])
def test_both_keys_at_once_are_refused(type_: str) -> None:
    with pytest.raises(Invalid, match=r'^node "w": give "signal" or its alias "event", not both$'):
        parse_spec(_doc({"id": "w", "type": type_, "signal": "a", "event": "b"}))


def test_the_old_key_on_another_node_type_is_still_unknown() -> None:
    with pytest.raises(Invalid, match=r'unknown key "event" for a WAIT node'):
        parse_spec(_doc({"id": "w", "type": "WAIT", "duration_s": 1, "event": "x"}))


def test_a_missing_signal_names_the_new_key() -> None:
    with pytest.raises(Invalid, match=r'^node "w": WAIT_FOR_SIGNAL node needs "signal" \(the signal name\)$'):
        parse_spec(_doc({"id": "w", "type": "WAIT_FOR_EVENT"}))
