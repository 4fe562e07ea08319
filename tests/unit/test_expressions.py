"""References: syntax, walking templates and resolution against context and outputs."""

from __future__ import annotations

from typing import Any

import pytest

from composer_ops.core.expressions import (
    Ref,
    is_ref,
    iter_refs,
    parse_ref,
    referenced_nodes,
    resolve,
)
from composer_ops.core.model import RunContext
from composer_ops.errors import Invalid

from .refusals import refusal

CONTEXT = RunContext(
    input={"amount": 12, "items": [{"sku": "a"}, {"sku": "b"}], "flag": False, "none": None},
    config={"region": "eu", "limits": {"max": 3}},
)
OUTPUTS: dict[str, Any] = {"charge": {"tier": "gold", "ids": [7, 8]}, "plain": 5, "nothing": None}


@pytest.mark.parametrize(
    ("text", "root", "node", "path"),
    [
        ("$.input", "input", None, ()),
        ("$.input.a.b", "input", None, ("a", "b")),
        ("$.config.x", "config", None, ("x",)),
        ("$.config", "config", None, ()),
        ("$.nodes.charge.output", "nodes", "charge", ()),
        ("$.nodes.charge.output.a.b", "nodes", "charge", ("a", "b")),
        ("$.nodes.n-1_x.output.0", "nodes", "n-1_x", ("0",)),
        ("$.input.with space", "input", None, ("with space",)),
    ],
)
def test_parse_ref(text: str, root: str, node: str | None, path: tuple[str, ...]) -> None:
    assert parse_ref(text) == Ref(text=text, root=root, node=node, path=path)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("$.", "empty path segment"),
        ("$.input.", "empty path segment"),
        ("$.input..a", "empty path segment"),
        ("$..input", "empty path segment"),
        ("$.inputs.a", 'unknown root "inputs"'),
        ("$.output", 'unknown root "output"'),
        ("$.nodes", "$.nodes.<id>.output"),
        ("$.nodes.x", "$.nodes.<id>.output"),
        ("$.nodes.x.outputs", "$.nodes.<id>.output"),
        ("$.nodes.x.input.a", "$.nodes.<id>.output"),
        ("$.nodes.b@d.output", "not a valid node id"),
        ("input.a", "starts with '$.'"),
        ("$input", "starts with '$.'"),
    ],
)
def test_parse_ref_rejects(text: str, fragment: str) -> None:
    message = refusal(parse_ref, text)
    assert fragment in message
    assert text in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [("$.input", True), ("$.", True), ("$input", False), ("a $.input", False), ("", False), (3, False), (None, False)],
)
def test_is_ref(value: object, expected: bool) -> None:
    assert is_ref(value) is expected


def test_referenced_nodes_walks_templates() -> None:
    template = {
        "a": "$.nodes.one.output",
        "b": ["$.nodes.two.output.x", {"c": "$.nodes.one.output.y"}, "$.input.z", "literal"],
        "d": 5,
        "$.nodes.keys.output": "keys are not references",
    }
    assert referenced_nodes(template) == {"one", "two"}
    assert referenced_nodes("$.nodes.solo.output") == {"solo"}
    assert referenced_nodes({"x": "US$ 5"}) == set()
    assert referenced_nodes(None) == set()


def test_referenced_nodes_rejects_bad_syntax() -> None:
    with pytest.raises(Invalid):
        referenced_nodes({"a": ["$.nodes.x"]})


def test_iter_refs_reports_locations() -> None:
    template = {"a": {"b": ["x", "$.input.q"]}, "c": "$.config"}
    assert list(iter_refs(template)) == [("a.b.1", "$.input.q"), ("c", "$.config")]
    assert list(iter_refs("$.input", "input")) == [("input", "$.input")]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("$.input", CONTEXT.input),
        ("$.input.amount", 12),
        ("$.input.items.1.sku", "b"),
        ("$.input.items.2.sku", None),
        ("$.input.items.x", None),
        ("$.input.amount.deeper", None),
        ("$.input.flag", False),
        ("$.input.none", None),
        ("$.input.missing", None),
        ("$.config.region", "eu"),
        ("$.config.limits.max", 3),
        ("$.nodes.charge.output", {"tier": "gold", "ids": [7, 8]}),
        ("$.nodes.charge.output.tier", "gold"),
        ("$.nodes.charge.output.ids.0", 7),
        ("$.nodes.plain.output", 5),
        ("$.nodes.plain.output.x", None),
        ("$.nodes.absent.output", None),
        ("$.nodes.absent.output.x", None),
        ("literal", "literal"),
        ("costs $5", "costs $5"),
        ("$5", "$5"),
        (42, 42),
        (None, None),
        (True, True),
    ],
)
def test_resolve(template: Any, expected: Any) -> None:
    assert resolve(template, CONTEXT, OUTPUTS) == expected


def test_resolve_nested_template() -> None:
    template = {
        "amount": "$.input.amount",
        "region": "$.config.region",
        "lines": ["$.input.items.0.sku", {"tier": "$.nodes.charge.output.tier"}, "plain"],
        "n": 1.5,
    }
    assert resolve(template, CONTEXT, OUTPUTS) == {
        "amount": 12,
        "region": "eu",
        "lines": ["a", {"tier": "gold"}, "plain"],
        "n": 1.5,
    }


def test_resolve_numeric_keys_of_objects() -> None:
    context = RunContext(input={"0": "zero", "list": ["a"]}, config={})
    assert resolve("$.input.0", context, {}) == "zero"
    assert resolve("$.input.list.0", context, {}) == "a"
    assert resolve("$.input.list.-1", context, {}) is None


def test_resolve_raises_on_bad_reference() -> None:
    with pytest.raises(Invalid):
        resolve({"a": "$.bogus"}, CONTEXT, OUTPUTS)
