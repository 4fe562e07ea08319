"""Workflow definition validation: every error names the node and the problem."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from composer_ops.core.model import NodeType
from composer_ops.core.retry import RetryPolicy
from composer_ops.core.spec import WorkflowSpec, parse_spec, spec_from_json
from composer_ops.errors import Invalid

from .refusals import refusal

EXAMPLE: dict[str, Any] = {
    "id": "order-fulfilment",
    "name": "Order fulfilment",
    "webhook_url": "https://example.invalid/hook",
    "config": {"region": "eu"},
    "nodes": [
        {
            "id": "charge",
            "type": "TASK",
            "task": "payments.charge",
            "queue": "payments",
            "input": {"amount": "$.input.amount", "region": "$.config.region"},
            "retry": {"max_attempts": 3, "initial_backoff_s": 1, "multiplier": 2, "max_backoff_s": 60},
            "lease_s": 30,
        },
        {
            "id": "route",
            "type": "SWITCH",
            "depends_on": ["charge"],
            "expression": "$.nodes.charge.output.tier",
            "cases": {"gold": ["express"]},
            "default": ["standard"],
        },
        {"id": "express", "type": "TASK", "task": "ship.express", "depends_on": ["route"]},
        {"id": "standard", "type": "TASK", "task": "ship.standard", "depends_on": ["route"]},
        {"id": "cool_off", "type": "WAIT", "depends_on": ["express", "standard"], "duration_s": 5},
        {
            "id": "delivered",
            "type": "WAIT_FOR_SIGNAL",
            "depends_on": ["cool_off"],
            "signal": "delivered",
            "timeout_s": 86400,
        },
        {
            "id": "notify",
            "type": "TASK",
            "task": "notify",
            "depends_on": ["delivered"],
            "input": {"proof": "$.nodes.delivered.output"},
        },
    ],
}


def example() -> dict[str, Any]:
    return copy.deepcopy(EXAMPLE)


def node(doc: dict[str, Any], node_id: str) -> dict[str, Any]:
    return next(n for n in doc["nodes"] if n["id"] == node_id)


def _change(target: dict[str, Any], changes: dict[str, Any]) -> None:
    """Set each key of ``changes`` in ``target``, or delete it where the value is ``...``."""
    for key, value in changes.items():
        if value is ...:
            target.pop(key, None)
        else:
            target[key] = value


def edit(node_id: str, **changes: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation of the example: set (or, with value ..., delete) keys of one node."""
    return lambda doc: _change(node(doc, node_id), changes)


def top(**changes: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation of the example: set (or, with value ..., delete) its top-level keys."""
    return lambda doc: _change(doc, changes)


def add(extra: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        doc["nodes"].append(extra)

    return apply


def test_example_parses() -> None:
    spec = parse_spec(EXAMPLE)
    assert isinstance(spec, WorkflowSpec)
    assert list(spec.nodes) == [n["id"] for n in EXAMPLE["nodes"]]
    assert spec.name == "Order fulfilment"
    assert spec.config == {"region": "eu"}
    assert spec.roots() == ("charge",)
    assert spec.sinks() == ("notify",)
    assert spec.dependents("route") == ("express", "standard")
    assert spec.dependents("notify") == ()
    charge = spec.nodes["charge"]
    assert charge.type is NodeType.TASK
    assert charge.queue == "payments"
    assert charge.retry == RetryPolicy(max_attempts=3, initial_backoff_s=1, multiplier=2, max_backoff_s=60)
    assert spec.nodes["route"].cases == {"gold": ("express",)}
    assert spec.nodes["route"].default == ("standard",)


def test_defaults() -> None:
    spec = parse_spec({"id": "w", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    a = spec.nodes["a"]
    assert spec.name == "w"
    assert spec.config == {}
    assert spec.webhook_url is None
    assert a.queue == "default"
    assert a.lease_s == 30
    assert a.max_lease_expiries == 3
    assert a.to_json()["max_lease_expiries"] == 3
    assert a.retry == RetryPolicy(max_attempts=1, initial_backoff_s=1, multiplier=2, max_backoff_s=60)
    assert a.optional is False
    assert a.input == {}


def test_to_json_round_trips_and_is_canonical() -> None:
    spec = parse_spec(EXAMPLE)
    doc = spec.to_json()
    assert parse_spec(doc) == spec
    assert parse_spec(doc).to_json() == doc
    assert node(doc, "express")["queue"] == "default"
    assert node(doc, "express")["retry"]["max_attempts"] == 1
    assert json.loads(json.dumps(doc)) == doc


def test_spec_from_json_accepts_text_and_objects() -> None:
    spec = parse_spec(EXAMPLE)
    assert spec_from_json(json.dumps(spec.to_json())) == spec
    assert spec_from_json(json.dumps(spec.to_json()).encode()) == spec
    assert spec_from_json(spec.to_json()) == spec
    with pytest.raises(Invalid, match="not valid JSON"):
        spec_from_json("{nope")


def test_topological_order_ignores_declaration_order() -> None:
    spec = parse_spec(
        {
            "id": "w",
            "nodes": [
                {"id": "c", "type": "WAIT", "duration_s": 1, "depends_on": ["b"]},
                {"id": "b", "type": "WAIT", "duration_s": 1, "depends_on": ["a"]},
                {"id": "a", "type": "WAIT", "duration_s": 1},
            ],
        }
    )
    assert spec.topological_order() == ("a", "b", "c")
    assert spec.roots() == ("a",)
    assert spec.sinks() == ("c",)


@pytest.mark.parametrize("until", ["2030-01-01T00:00:00Z", "2030-01-01T00:00:00+02:00", "$.input.deadline"])
def test_wait_until_forms(until: str) -> None:
    spec = parse_spec({"id": "w", "nodes": [{"id": "a", "type": "WAIT", "until": until}]})
    assert spec.nodes["a"].until == until
    assert parse_spec(spec.to_json()) == spec


def test_until_may_reference_an_upstream_output() -> None:
    doc = {
        "id": "w",
        "nodes": [
            {"id": "a", "type": "TASK", "task": "t"},
            {"id": "b", "type": "WAIT", "until": "$.nodes.a.output.at", "depends_on": ["a"]},
        ],
    }
    assert parse_spec(doc).nodes["b"].until == "$.nodes.a.output.at"


def test_transitive_upstream_reference_is_allowed() -> None:
    doc = example()
    node(doc, "notify")["input"] = {"paid": "$.nodes.charge.output.receipt"}
    parse_spec(doc)


def test_literal_dollar_strings_are_not_references() -> None:
    doc = example()
    node(doc, "notify")["input"] = {"price": "US$ 5", "tpl": "${x}", "money": "$5"}
    parse_spec(doc)


# Each case: a mutation of the example and fragments the one-line message must contain.
INVALID: list[tuple[str, Callable[[dict[str, Any]], None], tuple[str, ...]]] = [
    ("missing id", top(id=...), ('"id" is required',)),
    ("bad workflow id", top(id="has space"), ("workflow", "has space")),
    ("missing nodes", top(nodes=...), ('"nodes" is required',)),
    ("empty nodes", top(nodes=[]), ("non-empty list",)),
    ("unknown top key", top(webhook="x"), ('unknown key "webhook"',)),
    ("bad webhook scheme", top(webhook_url="ftp://x.invalid/h"), ("webhook_url", "http(s)")),
    ("webhook without host", top(webhook_url="https://"), ("webhook_url",)),
    ("webhook not a string", top(webhook_url=5), ("webhook_url",)),
    ("webhook bad port", top(webhook_url="http://h:99999/"), ("webhook_url",)),
    ("config not an object", top(config=[1]), ("config must be an object",)),
    ("name not a string", top(name=3), ("name",)),
    ("node not an object", add("x"), ("node #8", "must be an object")),  # type: ignore[arg-type]
    ("node without id", add({"type": "TASK", "task": "t"}), ("node #8", '"id" is required')),
    ("node id with dot", add({"id": "a.b", "type": "TASK", "task": "t"}), ("node #8", "a.b", "no dots")),
    ("unknown type", edit("express", type="TAKS"), ('node "express"', 'unknown type "TAKS"')),
    ("missing type", edit("express", type=...), ('node "express"', '"type" is required')),
    ("duplicate id", add({"id": "charge", "type": "TASK", "task": "t"}), ('node "charge"', "duplicate")),
    ("missing task", edit("express", task=...), ('node "express"', '"task"')),
    ("empty task", edit("express", task=""), ('node "express"', "task")),
    ("missing signal", edit("delivered", signal=...), ('node "delivered"', '"signal"')),
    ("missing expression", edit("route", expression=...), ('node "route"', '"expression"')),
    ("expression literal", edit("route", expression="tier"), ('node "route"', "expression", "$.")),
    ("unknown dependency", edit("express", depends_on=["route", "nope"]), ('node "express"', '"nope"')),
    ("self dependency", edit("express", depends_on=["express"]), ('node "express"', "itself")),
    ("duplicate dependency", edit("express", depends_on=["route", "route"]), ('node "express"', "twice")),
    ("depends_on not a list", edit("express", depends_on="route"), ('node "express"', "depends_on")),
    (
        "cycle",
        edit("charge", depends_on=["notify"]),
        ("cycle", '"charge" -> "route" -> "express" -> "cool_off" -> "delivered" -> "notify" -> "charge"'),
    ),
    (
        "switch case names a non-dependent",
        edit("route", cases={"gold": ["express", "cool_off"]}),
        ('node "route": SWITCH case "gold" names "cool_off", which does not depend on "route"',),
    ),
    (
        "switch default names a non-dependent",
        edit("route", default=["notify"]),
        ('node "route": SWITCH default names "notify", which does not depend on "route"',),
    ),
    (
        "a node only switches lead to, named by none",
        edit("route", default=[]),
        ('node "standard": depends only on SWITCH "route", and no case or default names it, so it would always '
         "be SKIPPED",),
    ),
    (
        "switch case names unknown",
        edit("route", cases={"gold": ["expres"]}),
        ('node "route"', '"expres"', "not a node"),
    ),
    ("switch case not a list", edit("route", cases={"gold": "express"}), ('node "route"', 'case "gold"', "list")),
    ("switch cases not an object", edit("route", cases=["express"]), ('node "route"', "cases")),
    ("switch case key not a string", edit("route", cases={1: ["express"]}), ('node "route"', "case 1", '"1"')),
    (
        "bad ref root",
        edit("charge", input={"a": "$.inptu.amount"}),
        ('node "charge"', "input.a", 'unknown root "inptu"'),
    ),
    ("empty segment", edit("charge", input={"a": {"b": ["$.input..x"]}}), ('node "charge"', "input.a.b.0", "empty")),
    ("nodes ref without output", edit("notify", input="$.nodes.delivered"), ('node "notify"', "output")),
    ("nodes ref wrong word", edit("notify", input={"p": "$.nodes.delivered.outptu"}), ('node "notify"', "input.p")),
    ("ref to unknown node", edit("notify", input={"p": "$.nodes.ghost.output"}), ('node "notify"', '"ghost"')),
    (
        "ref to non-upstream node",
        edit("express", input={"p": "$.nodes.standard.output"}),
        ('node "express"', '"standard"', "upstream"),
    ),
    ("bad expression ref", edit("route", expression="$.nodes.charge"), ('node "route"', "expression")),
    ("bad until ref", add({"id": "w", "type": "WAIT", "until": "$.bogus"}), ('node "w"', "until", "bogus")),
    ("until not a date", add({"id": "w", "type": "WAIT", "until": "tomorrow"}), ('node "w"', "until", "ISO-8601")),
    ("until without zone", add({"id": "w", "type": "WAIT", "until": "2030-01-01T00:00:00"}), ('node "w"', "until")),
    ("wait needs one", add({"id": "w", "type": "WAIT"}), ('node "w"', "exactly one")),
    (
        "wait has both",
        add({"id": "w", "type": "WAIT", "duration_s": 1, "until": "2030-01-01T00:00:00Z"}),
        ('node "w"', "exactly one"),
    ),
    ("negative duration", edit("cool_off", duration_s=-1), ('node "cool_off"', "duration_s", "negative")),
    ("non-numeric duration", edit("cool_off", duration_s="5"), ('node "cool_off"', "duration_s", "number")),
    ("boolean duration", edit("cool_off", duration_s=True), ('node "cool_off"', "duration_s")),
    ("huge duration", edit("cool_off", duration_s=1e12), ('node "cool_off"', "duration_s", "at most")),
    ("infinite duration", edit("cool_off", duration_s=float("inf")), ('node "cool_off"', "duration_s", "finite")),
    ("negative timeout", edit("delivered", timeout_s=-5), ('node "delivered"', "timeout_s")),
    ("zero lease", edit("charge", lease_s=0), ('node "charge"', "lease_s", "greater than 0")),
    ("negative lease", edit("charge", lease_s=-1), ('node "charge"', "lease_s")),
    ("bad on_timeout", edit("delivered", on_timeout="skip"), ('node "delivered"', "on_timeout")),
    ("negative lease expiries", edit("charge", max_lease_expiries=-1),
     ('node "charge"', "max_lease_expiries", "from 0 to 1000")),
    ("float lease expiries", edit("charge", max_lease_expiries=1.5), ('node "charge"', "max_lease_expiries")),
    ("bool lease expiries", edit("charge", max_lease_expiries=True), ('node "charge"', "max_lease_expiries")),
    ("huge lease expiries", edit("charge", max_lease_expiries=10**6), ('node "charge"', "max_lease_expiries")),
    ("lease expiries on a WAIT", edit("cool_off", max_lease_expiries=1), ('node "cool_off"', "TASK")),
    ("retry not an object", edit("charge", retry=3), ('node "charge"', "retry")),
    ("retry unknown key", edit("charge", retry={"max_attempt": 3}), ('node "charge"', '"max_attempt"')),
    ("retry zero attempts", edit("charge", retry={"max_attempts": 0}), ('node "charge"', "max_attempts")),
    ("retry float attempts", edit("charge", retry={"max_attempts": 2.5}), ('node "charge"', "max_attempts", "integer")),
    ("retry negative backoff", edit("charge", retry={"initial_backoff_s": -1}), ('node "charge"', "initial_backoff_s")),
    ("retry small multiplier", edit("charge", retry={"multiplier": 0.5}), ('node "charge"', "multiplier")),
    (
        "retry max below initial",
        edit("charge", retry={"initial_backoff_s": 10, "max_backoff_s": 5}),
        ('node "charge"', "max_backoff_s"),
    ),
    ("retry string backoff", edit("charge", retry={"max_backoff_s": "60"}), ('node "charge"', "max_backoff_s")),
    ("unknown node key", edit("charge", retires=3), ('node "charge"', 'unknown key "retires"')),
    ("key of another type", edit("cool_off", retry={}), ('node "cool_off"', '"retry"', "TASK")),
    ("optional not bool", edit("charge", optional="yes"), ('node "charge"', "optional")),
    ("bad queue", edit("charge", queue="pay ments"), ('node "charge"', "queue")),
    ("input not JSON", edit("charge", input={"a": {1, 2}}), ('node "charge"', "input.a", "JSON")),
]


@pytest.mark.parametrize(("mutate", "fragments"), [(m, f) for _, m, f in INVALID], ids=[i for i, _, _ in INVALID])
def test_invalid_specs(mutate: Callable[[dict[str, Any]], None], fragments: tuple[str, ...]) -> None:
    doc = example()
    mutate(doc)
    message = refusal(parse_spec, doc)
    for fragment in fragments:
        assert fragment in message


def test_not_an_object() -> None:
    with pytest.raises(Invalid, match="must be an object"):
        parse_spec([1, 2])  # type: ignore[arg-type]


def test_parse_does_not_mutate_input() -> None:
    doc = example()
    parse_spec(doc)
    assert doc == EXAMPLE


def test_a_webhook_url_with_credentials_is_refused_at_deploy_without_echoing_them() -> None:
    """docs/security.md said deploy refuses it; deploy took it, and every delivery of its
    runs was then given up. Refused now, naming no secret; a version deployed before
    keeps loading (its deliveries are still refused before each POST)."""
    doc = example()
    doc["webhook_url"] = "https://user:pa55w0rd@example.invalid/hook"
    with pytest.raises(Invalid) as refused:
        parse_spec(doc)
    assert str(refused.value) == ('workflow "order-fulfilment": webhook URL carries credentials; they are refused '
                                  "(they would end up in logs and rows)")
    assert parse_spec(doc, stored=True).webhook_url == doc["webhook_url"]


def test_a_deployed_version_with_a_node_no_switch_names_still_loads() -> None:
    """The rule came after 0.1.0's deploys: a stored version keeps loading, and its runs
    skip the node, as they always did."""
    doc = example()
    edit("route", default=[])(doc)
    with pytest.raises(Invalid, match="always be SKIPPED"):
        parse_spec(doc)
    assert parse_spec(doc, stored=True).nodes["standard"].depends_on == ("route",)


def test_a_huge_id_is_not_echoed_whole() -> None:
    with pytest.raises(Invalid) as refused:
        parse_spec({"id": "x" * 5000, "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    assert len(str(refused.value)) < 250 and str(refused.value).endswith("must match [A-Za-z0-9_.-]{1,128}")


@pytest.mark.parametrize(("value", "message"), [
    (None, "a workflow id must be a string (1 to 128 of A-Z a-z 0-9 _ . -), got NoneType"),
    (7, "a workflow id must be a string (1 to 128 of A-Z a-z 0-9 _ . -), got int"),
    ("no way", 'workflow id "no way" is not a workflow id'),
])
def test_a_bad_workflow_id_is_named_in_one_line(value: object, message: str) -> None:
    from composer_ops.engine.engine import _check_workflow_id

    with pytest.raises(Invalid) as refused:
        _check_workflow_id(value)
    assert str(refused.value).startswith(message)
