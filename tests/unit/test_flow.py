"""Flow control on a TASK node (core/flow.py through core/spec.py): what deploy accepts,
its canonical form, and the one-line refusals naming the node."""

from __future__ import annotations

from typing import Any

import pytest

from composer_ops.core.flow import NO_FLOW, Concurrency, FlowControl, RateLimit, Timeouts, slot_is_free
from composer_ops.core.spec import parse_spec
from composer_ops.errors import Invalid


def _spec(**flow: Any) -> dict[str, Any]:
    return {"id": "wf", "nodes": [
        {"id": "first", "type": "TASK", "task": "t"},
        {"id": "charge", "type": "TASK", "task": "t", "depends_on": ["first"], **flow}]}


def test_all_four_settings_parse_and_round_trip() -> None:
    spec = parse_spec(_spec(priority=7, timeouts={"schedule_to_start_s": 60, "start_to_close_s": 1.5},
                            concurrency={"key": "$.nodes.first.output.customer", "limit": 2},
                            rate_limit={"key": "payments-api", "per_s": 10, "burst": 20}))
    assert spec.nodes["charge"].flow == FlowControl(
        priority=7, timeouts=Timeouts(schedule_to_start_s=60, start_to_close_s=1.5),
        concurrency=Concurrency(key="$.nodes.first.output.customer", limit=2),
        rate_limit=RateLimit(key="payments-api", per_s=10, burst=20))
    assert parse_spec(spec.to_json()) == spec


def test_no_flow_control_keeps_the_canonical_form() -> None:
    spec = parse_spec(_spec())
    assert spec.nodes["charge"].flow is NO_FLOW
    assert not {"priority", "timeouts", "concurrency", "rate_limit"} & set(spec.to_json()["nodes"][1])


def test_rate_limit_burst_defaults_to_one_second_of_rate() -> None:
    spec = parse_spec(_spec(rate_limit={"key": "$.input.tenant", "per_s": 2.5}))
    assert spec.nodes["charge"].flow.rate_limit == RateLimit(key="$.input.tenant", per_s=2.5, burst=3)


@pytest.mark.parametrize(("flow", "message"), [
    ({"concurrency": {"key": "$.input.c", "limit": -1}}, 'node "charge": concurrency.limit must be an integer'),
    ({"concurrency": {"key": "$.input.c", "limit": 0}}, 'node "charge": concurrency.limit must be an integer'),
    ({"concurrency": {"key": "customer", "limit": 1}}, 'node "charge": concurrency.key must be a $. reference'),
    ({"concurrency": {"key": "$.inptu.c", "limit": 1}}, 'node "charge": concurrency.key: bad reference'),
    ({"concurrency": {"key": "$.nodes.nope.output", "limit": 1}},
     'node "charge": concurrency.key references unknown node "nope"'),
    ({"concurrency": {"limit": 1}}, 'node "charge": concurrency needs "key"'),
    ({"concurrency": {"key": "$.input.c", "limit": 1, "strategy": "x"}},
     'node "charge": concurrency: unknown key "strategy"'),
    ({"rate_limit": {"key": "api", "per_s": 0}}, 'node "charge": rate_limit.per_s must be greater than 0'),
    ({"rate_limit": {"key": "api", "per_s": -3}}, 'node "charge": rate_limit.per_s must be greater than 0'),
    ({"rate_limit": {"key": "api", "per_s": float("nan")}}, 'node "charge": rate_limit.per_s must be a finite'),
    ({"rate_limit": {"key": "api", "per_s": 1, "burst": 0}}, 'node "charge": rate_limit.burst must be an integer'),
    ({"rate_limit": {"key": "a b", "per_s": 1}}, 'node "charge": rate_limit.key must be a name'),
    ({"rate_limit": {"key": "$.nodes.first", "per_s": 1}}, "node \"charge\": rate_limit.key: bad reference"),
    ({"rate_limit": {"per_s": 1}}, 'node "charge": rate_limit needs "key"'),
    ({"priority": 1.5}, 'node "charge": priority must be an integer from -32768 to 32767'),
    ({"priority": True}, 'node "charge": priority must be an integer'),
    ({"priority": 40000}, 'node "charge": priority must be an integer'),
    ({"timeouts": {}}, 'node "charge": timeouts must name at least one'),
    ({"timeouts": {"schedule_to_start_s": 0}}, 'node "charge": timeouts.schedule_to_start_s must be greater'),
    ({"timeouts": {"start_to_close_s": -1}}, 'node "charge": timeouts.start_to_close_s must be greater'),
    ({"timeouts": {"heartbeat_s": 1}}, 'node "charge": timeouts: unknown key "heartbeat_s"'),
    ({"timeouts": 5}, 'node "charge": timeouts must be an object'),
])
def test_bad_settings_are_refused_in_one_line(flow: dict[str, Any], message: str) -> None:
    with pytest.raises(Invalid) as caught:
        parse_spec(_spec(**flow))
    text = str(caught.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_a_key_on_a_node_that_is_not_upstream_is_refused() -> None:
    doc = {"id": "wf", "nodes": [
        {"id": "a", "type": "TASK", "task": "t"},
        {"id": "b", "type": "TASK", "task": "t", "concurrency": {"key": "$.nodes.a.output.k", "limit": 1}}]}
    with pytest.raises(Invalid, match='node "b": concurrency.key references "a", which is not upstream'):
        parse_spec(doc)


def test_flow_keys_belong_to_task_nodes_only() -> None:
    doc = {"id": "wf", "nodes": [{"id": "w", "type": "WAIT", "duration_s": 1, "priority": 3}]}
    with pytest.raises(Invalid, match='node "w": unknown key "priority" for a WAIT node'):
        parse_spec(doc)


@pytest.mark.parametrize(("value", "text"), [
    ("A", "A"), (42, "42"), ("x y", "x y"), (None, "null"), ({"b": 1, "a": [2]}, '{"a":[2],"b":1}'), (True, "true"),
])
def test_a_resolved_key_is_its_string_or_canonical_json(value: Any, text: str) -> None:
    from composer_ops.core.flow import key_text

    assert key_text(value) == text


@pytest.mark.parametrize(("seen", "free"), [
    ((3, "RUNNING"), False),                  # the attempt runs
    ((3, "QUEUED"), False),                   # its claim committed on the coordinator, not yet on the node
    ((3, "PENDING"), False),
    ((4, "PENDING"), True),                   # re-queued after a failure or a lost lease
    ((4, "RUNNING"), True),                   # the next attempt runs: it takes its own slot
    ((3, "COMPLETED"), True),
    ((3, "FAILED"), True),
    ((3, "CANCELLED"), True),
    (None, True),                             # the task is gone (its run retried or deleted)
])
def test_a_slot_is_free_only_once_its_attempt_is_over(seen: tuple[int, str] | None, free: bool) -> None:
    assert slot_is_free(3, seen) is free
