"""Workflow definitions: validation at deploy time and the parsed, immutable spec.

``parse_spec`` turns a JSON (or YAML-loaded) document into a ``WorkflowSpec`` or
raises ``Invalid`` with one line naming the node and the problem. ``to_json`` gives
the canonical document (every default spelled out) that is stored in
``workflow_definitions.spec_json``; ``spec_from_json`` rebuilds the spec from it.
Both are pure, so the shell may cache the result by ``(workflow_id, version)``.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from composer_ops.core.expressions import NODE_ID_PATTERN, is_ref, iter_refs, parse_ref
from composer_ops.core.flow import FLOW_KEYS, NO_FLOW, FlowControl, flow_refs, parse_flow
from composer_ops.core.graph import ancestors, find_cycle, topological_order
from composer_ops.core.instants import RANGE_TEXT, instant_in_range, parse_instant
from composer_ops.core.model import NodeType
from composer_ops.core.retry import DEFAULT_RETRY, RetryPolicy
from composer_ops.errors import Invalid

__all__ = ["ID_PATTERN", "NodeSpec", "WorkflowSpec", "parse_spec", "spec_from_json"]

#: Workflow ids and queue names. Node ids follow ``NODE_ID_PATTERN`` (no dots).
ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,128}")

_TOP_KEYS = frozenset({"id", "name", "description", "webhook_url", "config", "nodes"})
_COMMON_KEYS = frozenset({"id", "type", "depends_on", "optional", "description"})
_TYPE_KEYS: Mapping[NodeType, frozenset[str]] = {
    NodeType.TASK: frozenset({"task", "queue", "input", "retry", "lease_s", "max_lease_expiries"}) | FLOW_KEYS,
    NodeType.SWITCH: frozenset({"expression", "cases", "default"}),
    NodeType.WAIT: frozenset({"duration_s", "until"}),
    NodeType.WAIT_FOR_SIGNAL: frozenset({"signal", "timeout_s", "on_timeout"}),
    NodeType.SUB_WORKFLOW: frozenset({"workflow", "version", "input"}),
    NodeType.MAP: frozenset({"items", "task", "queue", "input", "retry", "lease_s", "max_lease_expiries",
                             "max_parallel", "on_item_failure"}),
}
#: Spellings of 0.1.0 that specs keep using (SPEC's examples): an alias type, and an
#: alias key of that type's node. Parsing turns them into the current names, so a
#: stored definition holds these only if it was deployed by 0.1.0.
_TYPE_ALIASES: Mapping[str, NodeType] = {"WAIT_FOR_EVENT": NodeType.WAIT_FOR_SIGNAL}
_KEY_ALIASES: Mapping[NodeType, Mapping[str, str]] = {NodeType.WAIT_FOR_SIGNAL: {"event": "signal"}}
_RETRY_KEYS = ("max_attempts", "initial_backoff_s", "multiplier", "max_backoff_s")
_ON_TIMEOUT = ("fail", "continue")
_ON_ITEM_FAILURE = ("fail", "continue")
#: Items of a MAP node in flight at once unless ``max_parallel`` says otherwise.
DEFAULT_MAX_PARALLEL = 10
MAX_PARALLEL_LIMIT = 10_000
#: Longest accepted duration: a century keeps every wake-up inside datetime's range.
MAX_SECONDS = 100 * 365 * 86_400
#: Lease expiries a TASK survives by default: each re-queues it without consuming its
#: retry policy; the next one fails it.
DEFAULT_MAX_LEASE_EXPIRIES = 3
MAX_LEASE_EXPIRIES_LIMIT = 1000


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """One validated node. Fields that do not apply to ``type`` keep their defaults."""

    id: str
    type: NodeType
    depends_on: tuple[str, ...] = ()
    optional: bool = False
    description: str | None = None
    # TASK
    task: str | None = None
    queue: str | None = None
    input: Any = None
    retry: RetryPolicy = DEFAULT_RETRY
    lease_s: float = 30
    max_lease_expiries: int = DEFAULT_MAX_LEASE_EXPIRIES
    flow: FlowControl = NO_FLOW      # priority, timeouts, concurrency, rate_limit (core/flow.py)
    # SWITCH
    expression: str | None = None
    cases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    default: tuple[str, ...] = ()
    # WAIT
    duration_s: float | None = None
    until: str | None = None
    # WAIT_FOR_SIGNAL (the JSON key is "signal")
    signal_name: str | None = None
    timeout_s: float | None = None
    on_timeout: str = "fail"
    # MAP (with task, queue, input, retry, lease_s, max_lease_expiries, applied per item)
    items: str | None = None
    max_parallel: int = DEFAULT_MAX_PARALLEL
    on_item_failure: str = "fail"
    # SUB_WORKFLOW (with input): the child's workflow id and version (None: the deployed one)
    workflow: str | None = None
    version: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The canonical document of this node: every applicable default spelled out."""
        doc: dict[str, Any] = {"id": self.id, "type": str(self.type)}
        if self.description is not None:
            doc["description"] = self.description
        doc["depends_on"] = list(self.depends_on)
        doc["optional"] = self.optional
        if self.type is NodeType.TASK or self.type is NodeType.MAP:
            if self.type is NodeType.MAP:
                doc.update(items=self.items, max_parallel=self.max_parallel, on_item_failure=self.on_item_failure)
            doc.update(
                task=self.task,
                queue=self.queue,
                input=self.input,
                retry={key: getattr(self.retry, key) for key in _RETRY_KEYS},
                lease_s=self.lease_s,
                max_lease_expiries=self.max_lease_expiries,
                **self.flow.to_json(),
            )
        elif self.type is NodeType.SWITCH:
            doc.update(
                expression=self.expression,
                cases={key: list(value) for key, value in self.cases.items()},
                default=list(self.default),
            )
        elif self.type is NodeType.SUB_WORKFLOW:
            doc["workflow"] = self.workflow
            if self.version is not None:
                doc["version"] = self.version
            doc["input"] = self.input
        elif self.type is NodeType.WAIT:
            if self.duration_s is not None:
                doc["duration_s"] = self.duration_s
            else:
                doc["until"] = self.until
        else:
            doc["signal"] = self.signal_name
            if self.timeout_s is not None:
                doc["timeout_s"] = self.timeout_s
            doc["on_timeout"] = self.on_timeout
        return doc


@dataclass(frozen=True, kw_only=True)
class WorkflowSpec:
    """A validated workflow definition; ``nodes`` keeps declaration order."""

    id: str
    name: str
    nodes: Mapping[str, NodeSpec]
    webhook_url: str | None = None
    description: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    _dependents: Mapping[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    _order: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dependents: dict[str, list[str]] = {node_id: [] for node_id in self.nodes}
        for node in self.nodes.values():
            for dep in node.depends_on:
                dependents[dep].append(node.id)
        object.__setattr__(self, "_dependents", {k: tuple(v) for k, v in dependents.items()})
        object.__setattr__(self, "_order", topological_order(self.nodes))

    def dependents(self, node_id: str) -> tuple[str, ...]:
        """The nodes that list ``node_id`` in ``depends_on``, in declaration order."""
        return self._dependents[node_id]

    def roots(self) -> tuple[str, ...]:
        """Nodes without dependencies: what a new run starts with."""
        return tuple(n.id for n in self.nodes.values() if not n.depends_on)

    def sinks(self) -> tuple[str, ...]:
        """Nodes nothing depends on: their outputs make up the run's output."""
        return tuple(node_id for node_id in self.nodes if not self._dependents[node_id])

    def topological_order(self) -> tuple[str, ...]:
        """Every node after all of its dependencies; ties keep declaration order."""
        return self._order

    def to_json(self) -> dict[str, Any]:
        """The canonical document: ``parse_spec(spec.to_json()) == spec``."""
        doc: dict[str, Any] = {"id": self.id, "name": self.name}
        if self.description is not None:
            doc["description"] = self.description
        if self.webhook_url is not None:
            doc["webhook_url"] = self.webhook_url
        doc["config"] = dict(self.config)
        doc["nodes"] = [node.to_json() for node in self.nodes.values()]
        return doc


# ---------------------------------------------------------------------------
# Validation helpers. Each raises Invalid with a message ready to show a user.


def _q(value: object) -> str:
    """A value quoted for a one-line message; never raises (an int of more than
    4,300 digits cannot be printed, and a message must not fail on bad input)."""
    if isinstance(value, str):      # an id (at most 128 characters) in full; a longer text cut
        text = json.dumps(value)
        return text if len(text) <= 140 else text[:137] + "..."
    try:
        text = repr(value)
    except ValueError:
        return f"<{type(value).__name__} too large to print>"
    return text if len(text) <= 80 else text[:77] + "..."


def _check_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid(f"{where}: {value!r} is not a JSON number")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}.{i}")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise Invalid(f"{where}: key {key!r} is not a string")
            _check_json(item, f"{where}.{key}")
        return
    raise Invalid(f"{where}: {type(value).__name__} {value!r} is not a JSON value")


def _number(value: Any, where: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(f"{where} must be a number of seconds, got {_q(value)}")
    if not math.isfinite(value):
        raise Invalid(f"{where} must be a finite number of seconds, got {value!r}")
    if value < 0:
        raise Invalid(f"{where} must not be negative, got {value}")
    if value > MAX_SECONDS:
        raise Invalid(f"{where} must be at most {MAX_SECONDS} (100 years), got {value}")
    if positive and value == 0:
        raise Invalid(f"{where} must be greater than 0")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise Invalid(f"{where} must be a non-empty string, got {_q(value)}")
    return value


def _id_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Invalid(f"{where} must be a list of node ids, got {_q(value)}")
    seen: set[str] = set()
    for item in value:
        if item in seen:
            raise Invalid(f"{where} lists {_q(item)} twice")
        seen.add(item)
    return tuple(value)


def _check_ref(text: str, where: str) -> None:
    try:
        parse_ref(text)
    except Invalid as exc:
        raise Invalid(f"{where}: {exc}") from None


def _parse_retry(value: Any, where: str) -> RetryPolicy:
    if not isinstance(value, dict):
        raise Invalid(f"{where}: retry must be an object, got {_q(value)}")
    unknown = sorted(set(value) - set(_RETRY_KEYS))
    if unknown:
        raise Invalid(f"{where}: unknown retry key {_q(unknown[0])} (allowed: {', '.join(_RETRY_KEYS)})")
    max_attempts = value.get("max_attempts", DEFAULT_RETRY.max_attempts)
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
        raise Invalid(f"{where}: retry.max_attempts must be an integer, got {_q(max_attempts)}")
    numbers = {
        key: _number(value.get(key, getattr(DEFAULT_RETRY, key)), f"{where}: retry.{key}") for key in _RETRY_KEYS[1:]
    }
    try:
        return RetryPolicy(max_attempts=max_attempts, **numbers)
    except Invalid as exc:
        raise Invalid(f"{where}: {exc}") from None


def _max_lease_expiries(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LEASE_EXPIRIES_LIMIT:
        raise Invalid(f"{where}: max_lease_expiries must be an integer from 0 to {MAX_LEASE_EXPIRIES_LIMIT}, "
                      f"got {_q(value)}")
    return value


def _parse_node(raw: Any, index: int, seen: set[str], stored: bool = False) -> NodeSpec:
    if not isinstance(raw, dict):
        raise Invalid(f"node #{index + 1}: must be an object, got {_q(raw)}")
    node_id = raw.get("id")
    if node_id is None:
        raise Invalid(f'node #{index + 1}: "id" is required')
    if not isinstance(node_id, str) or not NODE_ID_PATTERN.fullmatch(node_id):
        raise Invalid(
            f"node #{index + 1}: id {_q(node_id)} must match [A-Za-z0-9_-]{{1,128}} "
            "(no dots: they separate the segments of a $.nodes reference)"
        )
    where = f"node {_q(node_id)}"
    if node_id in seen:
        raise Invalid(f"{where}: duplicate node id")
    seen.add(node_id)

    raw_type = raw.get("type")
    if raw_type is None:
        raise Invalid(f'{where}: "type" is required (one of {", ".join(NodeType)})')
    if isinstance(raw_type, str) and raw_type in _TYPE_ALIASES:
        node_type = _TYPE_ALIASES[raw_type]
    elif isinstance(raw_type, str) and raw_type in NodeType.__members__:
        node_type = NodeType(raw_type)
    else:
        raise Invalid(f"{where}: unknown type {_q(raw_type)} (expected one of {', '.join(NodeType)})")
    for alias, key in _KEY_ALIASES.get(node_type, {}).items():
        if alias in raw:
            if key in raw:
                raise Invalid(f"{where}: give {_q(key)} or its alias {_q(alias)}, not both")
            raw = {(key if k == alias else k): v for k, v in raw.items()}

    allowed = _COMMON_KEYS | _TYPE_KEYS[node_type]
    for key in raw:
        if key not in allowed:
            other = [str(t) for t, keys in _TYPE_KEYS.items()
                     if key in keys or key in _KEY_ALIASES.get(t, {})]
            hint = f" (it belongs to {' / '.join(other)} nodes)" if other else ""
            raise Invalid(f"{where}: unknown key {_q(key)} for a {node_type} node{hint}")

    depends_on = _id_list(raw.get("depends_on", []), f"{where}: depends_on")
    optional = raw.get("optional", False)
    if not isinstance(optional, bool):
        raise Invalid(f"{where}: optional must be true or false, got {_q(optional)}")
    description = raw.get("description")
    if description is not None and not isinstance(description, str):
        raise Invalid(f"{where}: description must be a string, got {_q(description)}")
    common: dict[str, Any] = dict(
        id=node_id, type=node_type, depends_on=depends_on, optional=optional, description=description
    )

    if node_type is NodeType.TASK or node_type is NodeType.MAP:
        if "task" not in raw:
            raise Invalid(f'{where}: {node_type} node needs "task" (the handler name)')
        queue = raw.get("queue", "default")
        if not isinstance(queue, str) or not ID_PATTERN.fullmatch(queue):
            raise Invalid(f"{where}: queue {_q(queue)} must match [A-Za-z0-9_.-]{{1,128}}")
        template = raw.get("input", {})
        _check_json(template, f"{where}: input")
        for loc, text in iter_refs(template, "input"):
            _check_ref(text, f"{where}: {loc}")
        if node_type is NodeType.MAP:
            common.update(_map_fields(raw, where))
        return NodeSpec(
            **common,
            task=_text(raw["task"], f"{where}: task"),
            queue=queue,
            input=template,
            retry=_parse_retry(raw["retry"], where) if "retry" in raw else DEFAULT_RETRY,
            lease_s=_number(raw.get("lease_s", 30), f"{where}: lease_s", positive=True),
            max_lease_expiries=_max_lease_expiries(raw.get("max_lease_expiries", DEFAULT_MAX_LEASE_EXPIRIES),
                                                   where),
            flow=parse_flow(raw, where),
        )

    if node_type is NodeType.SUB_WORKFLOW:
        return NodeSpec(**common, **_sub_workflow_fields(raw, where))

    if node_type is NodeType.SWITCH:
        if "expression" not in raw:
            raise Invalid(f'{where}: SWITCH node needs "expression" (a $. reference)')
        expression = raw["expression"]
        if not is_ref(expression):
            raise Invalid(f"{where}: expression must be a $. reference, got {_q(expression)}")
        _check_ref(expression, f"{where}: expression")
        cases = raw.get("cases", {})
        if not isinstance(cases, dict):
            raise Invalid(f"{where}: cases must be an object of value -> node ids, got {_q(cases)}")
        for key in cases:
            if not isinstance(key, str):
                label = json.dumps(json.dumps(key, default=str))
                raise Invalid(f"{where}: SWITCH case {key!r} must be a string (write it as {label})")
        return NodeSpec(
            **common,
            expression=expression,
            cases={k: _id_list(v, f"{where}: SWITCH case {_q(k)}") for k, v in cases.items()},
            default=_id_list(raw.get("default", []), f"{where}: SWITCH default"),
        )

    if node_type is NodeType.WAIT:
        has_duration, has_until = "duration_s" in raw, "until" in raw
        if has_duration == has_until:
            raise Invalid(f'{where}: WAIT node needs exactly one of "duration_s" and "until"')
        if has_duration:
            return NodeSpec(**common, duration_s=_number(raw["duration_s"], f"{where}: duration_s"))
        until = raw["until"]
        if is_ref(until):
            _check_ref(until, f"{where}: until")
        elif not isinstance(until, str) or (instant := parse_instant(until)) is None:
            raise Invalid(
                f"{where}: until must be an ISO-8601 instant with a time zone "
                f"(like 2030-01-01T00:00:00Z) or a $. reference, got {_q(until)}"
            )
        elif not stored and not instant_in_range(instant):
            # a stored definition keeps loading: its run fails the node (machine.create_wait)
            raise Invalid(f"{where}: until {_q(until)} is outside the instants the database can store and read "
                          f"back ({RANGE_TEXT})")
        return NodeSpec(**common, until=until)

    if "signal" not in raw:
        raise Invalid(f'{where}: WAIT_FOR_SIGNAL node needs "signal" (the signal name)')
    timeout = raw.get("timeout_s")
    on_timeout = raw.get("on_timeout", "fail")
    if on_timeout not in _ON_TIMEOUT:
        raise Invalid(f'{where}: on_timeout must be "fail" or "continue", got {_q(on_timeout)}')
    return NodeSpec(
        **common,
        signal_name=_text(raw["signal"], f"{where}: signal"),
        timeout_s=None if timeout is None else _number(timeout, f"{where}: timeout_s"),
        on_timeout=on_timeout,
    )


def _map_fields(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The MAP-only fields of a node (its TASK-like fields are parsed as a TASK's)."""
    if "items" not in raw:
        raise Invalid(f'{where}: MAP node needs "items" (a $. reference to a list)')
    items = raw["items"]
    if not is_ref(items):
        raise Invalid(f"{where}: items must be a $. reference to a list, got {_q(items)}")
    _check_ref(items, f"{where}: items")
    max_parallel = raw.get("max_parallel", DEFAULT_MAX_PARALLEL)
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or not (
            1 <= max_parallel <= MAX_PARALLEL_LIMIT):
        raise Invalid(f"{where}: max_parallel must be an integer from 1 to {MAX_PARALLEL_LIMIT}, "
                      f"got {_q(max_parallel)}")
    on_item_failure = raw.get("on_item_failure", "fail")
    if on_item_failure not in _ON_ITEM_FAILURE:
        raise Invalid(f'{where}: on_item_failure must be "fail" or "continue", got {_q(on_item_failure)}')
    return {"items": items, "max_parallel": max_parallel, "on_item_failure": on_item_failure}


def _sub_workflow_fields(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    if "workflow" not in raw:
        raise Invalid(f'{where}: SUB_WORKFLOW node needs "workflow" (the child workflow\'s id)')
    workflow = raw["workflow"]
    if not isinstance(workflow, str) or not ID_PATTERN.fullmatch(workflow):
        raise Invalid(f"{where}: workflow {_q(workflow)} must match [A-Za-z0-9_.-]{{1,128}}")
    version = raw.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise Invalid(f"{where}: version must be a positive integer, got {_q(version)}")
    template = raw.get("input", {})
    _check_json(template, f"{where}: input")
    for loc, text in iter_refs(template, "input"):
        _check_ref(text, f"{where}: {loc}")
    return {"workflow": workflow, "version": version, "input": template}


def _node_refs(node: NodeSpec) -> list[tuple[str, str]]:
    if node.type is NodeType.MAP and node.items is not None:
        return [("items", node.items), *iter_refs(node.input, "input")]
    if node.type is NodeType.TASK:
        return [*iter_refs(node.input, "input"), *flow_refs(node.flow)]
    if node.type is NodeType.SUB_WORKFLOW:
        return list(iter_refs(node.input, "input"))
    if node.type is NodeType.SWITCH and node.expression is not None:
        return [("expression", node.expression)]
    if node.type is NodeType.WAIT and node.until is not None and is_ref(node.until):
        return [("until", node.until)]
    return []


def _check_graph(nodes: Mapping[str, NodeSpec], stored: bool = False) -> None:
    for node in nodes.values():
        for dep in node.depends_on:
            if dep == node.id:
                raise Invalid(f"node {_q(node.id)}: depends on itself")
            if dep not in nodes:
                raise Invalid(f"node {_q(node.id)}: depends on unknown node {_q(dep)}")
    cycle = find_cycle(nodes)
    if cycle is not None:
        # Found along depends_on edges; shown in run order, each node before its dependent.
        chain = " -> ".join(_q(n) for n in reversed(cycle))
        raise Invalid(f"node {_q(cycle[0])}: dependency cycle {chain}")
    for node in nodes.values():
        if node.type is not NodeType.SWITCH:
            continue
        labelled = [(f"SWITCH case {_q(k)}", v) for k, v in node.cases.items()]
        for label, targets in [*labelled, ("SWITCH default", node.default)]:
            for target in targets:
                if target not in nodes:
                    raise Invalid(f"node {_q(node.id)}: {label} names {_q(target)}, which is not a node")
                if node.id not in nodes[target].depends_on:
                    raise Invalid(
                        f"node {_q(node.id)}: {label} names {_q(target)}, which does not depend on {_q(node.id)}"
                    )
    if not stored:        # a version deployed before this rule keeps loading: its runs skip the node
        _check_reachable(nodes)
    above = ancestors(nodes, topological_order(nodes))
    for node in nodes.values():
        for loc, text in _node_refs(node):
            upstream = parse_ref(text).node
            if upstream is None:
                continue
            if upstream not in nodes:
                raise Invalid(f"node {_q(node.id)}: {loc} references unknown node {_q(upstream)}")
            if upstream not in above[node.id]:
                raise Invalid(
                    f"node {_q(node.id)}: {loc} references {_q(upstream)}, which is not upstream of "
                    f"{_q(node.id)} (add it to depends_on, directly or transitively)"
                )


def _check_reachable(nodes: Mapping[str, NodeSpec]) -> None:
    """Refuse a node every dependency of which is a SWITCH that names it in no case and
    not in its default: no decision can make it run, so it would always be SKIPPED (a
    dependency on any other node, or a SWITCH that names it, can)."""
    def names(switch: NodeSpec, node_id: str) -> bool:
        return any(node_id in targets for targets in [*switch.cases.values(), switch.default])

    for node in nodes.values():
        deps = [nodes[d] for d in node.depends_on]
        if deps and all(d.type is NodeType.SWITCH and not names(d, node.id) for d in deps):
            switches = ", ".join(_q(d.id) for d in deps)
            raise Invalid(f"node {_q(node.id)}: depends only on SWITCH {switches}, and no case or default names "
                          "it, so it would always be SKIPPED (name it in a case or the default)")


def parse_spec(doc: Mapping[str, Any], *, stored: bool = False) -> WorkflowSpec:
    """Validate a workflow definition document and return the parsed spec.

    Raises ``Invalid`` with a one-line message naming the node and the problem.
    ``stored``: the document is an already deployed version being loaded; a rule that
    runs decide when they reach the node (an until outside the storable range) is left
    to them, so runs already started on the version can finish.
    """
    if not isinstance(doc, Mapping):
        raise Invalid(f"workflow definition must be an object, got {_q(doc)}")
    workflow_id = doc.get("id")
    if workflow_id is None:
        raise Invalid('workflow: "id" is required')
    if not isinstance(workflow_id, str) or not ID_PATTERN.fullmatch(workflow_id):
        raise Invalid(f"workflow: id {_q(workflow_id)} must match [A-Za-z0-9_.-]{{1,128}}")
    where = f"workflow {_q(workflow_id)}"
    for key in doc:
        if key not in _TOP_KEYS:
            raise Invalid(f"{where}: unknown key {_q(key)} (allowed: {', '.join(sorted(_TOP_KEYS))})")
    name = _text(doc.get("name", workflow_id), f"{where}: name")
    description = doc.get("description")
    if description is not None and not isinstance(description, str):
        raise Invalid(f"{where}: description must be a string, got {_q(description)}")
    webhook_url = doc.get("webhook_url")
    if webhook_url is not None:
        _check_url(webhook_url, where, stored)
    config = doc.get("config", {})
    if not isinstance(config, dict):
        raise Invalid(f"{where}: config must be an object, got {_q(config)}")
    _check_json(config, f"{where}: config")
    raw_nodes = doc.get("nodes")
    if raw_nodes is None:
        raise Invalid(f'{where}: "nodes" is required')
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise Invalid(f"{where}: nodes must be a non-empty list of node objects")

    seen: set[str] = set()
    parsed = [_parse_node(raw, i, seen, stored) for i, raw in enumerate(raw_nodes)]
    nodes = {node.id: node for node in parsed}
    _check_graph(nodes, stored)
    return WorkflowSpec(
        id=workflow_id,
        name=name,
        description=description,
        webhook_url=webhook_url,
        config=config,
        nodes=nodes,
    )


#: Why a webhook URL with a user or password is refused: at deploy, and again before
#: every POST (engine/webhooks.py; a version deployed before the deploy check keeps loading).
CREDENTIALS_REFUSED = "webhook URL carries credentials; they are refused (they would end up in logs and rows)"


#: Cloud metadata endpoints outside the link-local range: AWS's over IPv6 (its IPv4 one,
#: 169.254.169.254, is link-local like GCP's, Azure's and Oracle's) and Alibaba's.
METADATA_ADDRESSES = frozenset({ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def refused_address(address: str) -> str | None:
    """Why a webhook may not be sent to the IP ``address``, or None: a link-local address
    (169.254.0.0/16, fe80::/10, where cloud metadata services answer), a known metadata
    endpoint (:data:`METADATA_ADDRESSES`), an unspecified or a multicast one; an IPv4
    address inside IPv6 (mapped, compatible, NAT64, 6to4, Teredo) is judged as itself, and
    one spelled as the C library reads it (``2852039166``, ``0xa9fea9fe``, ``0251.0376.0251.0376``)
    too. Loopback and private networks are allowed: receivers often live there
    (docs/security.md). Not a firewall: an egress policy is the place for more."""
    text = address.split("%", 1)[0]              # an IPv6 zone (fe80::1%eth0) names no other address
    if text[:1].isdigit():
        text = text.rstrip(".")                  # 169.254.169.254. is the same address
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(text)
    except ValueError:
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(text))      # the spellings inet_aton takes
        except (OSError, ValueError):
            return None
    seen = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        inner = [ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None]
        if ip in _NAT64 or (int(ip) >> 32 == 0 and int(ip) > 0xFFFF):   # NAT64; IPv4-compatible (::a.b.c.d)
            inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        seen += [i for i in inner if i is not None]
    for one in seen:
        kind = ("a link-local" if one.is_link_local else "a cloud metadata" if one in METADATA_ADDRESSES
                else "an unspecified" if one.is_unspecified else "a multicast" if one.is_multicast else None)
        if kind:
            return f"webhook URL reaches {one}, {kind} address: refused"
    return None


def _check_url(url: Any, where: str, stored: bool) -> None:
    if not isinstance(url, str):
        raise Invalid(f"{where}: webhook_url must be a string, got {_q(url)}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise Invalid(f"{where}: webhook_url {_q(url)} is not a valid URL ({exc})") from None
    if not stored and (parts.username is not None or parts.password is not None):
        raise Invalid(f"{where}: {CREDENTIALS_REFUSED}")         # the URL is not echoed: it holds them
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise Invalid(f"{where}: webhook_url must be an http(s) URL with a host, got {_q(url)}")
    refused = None if stored else refused_address(parts.hostname)
    if refused is not None:
        raise Invalid(f"{where}: {refused}")


def spec_from_json(doc: Mapping[str, Any] | str | bytes) -> WorkflowSpec:
    """Rebuild a spec from stored ``spec_json`` (a decoded object or JSON text).

    ``parse_spec`` of a deployed version (``stored``); the shell caches the result by
    ``(workflow_id, version)`` because a deployed version never changes.
    """
    if not isinstance(doc, str | bytes):
        return parse_spec(doc, stored=True)
    try:
        decoded = json.loads(doc)
    except ValueError as exc:
        raise Invalid(f"stored workflow definition is not valid JSON: {exc}") from None
    return parse_spec(decoded, stored=True)
