"""Graph algorithms over a workflow's ``depends_on`` edges: order, cycles, ancestry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from composer_ops.errors import Invalid

if TYPE_CHECKING:
    from composer_ops.core.spec import NodeSpec

__all__ = ["ancestors", "find_cycle", "topological_order"]


def topological_order(nodes: Mapping[str, NodeSpec]) -> tuple[str, ...]:
    # Kahn's algorithm, always taking the earliest-declared ready node, so the order
    # (and with it the order of CreateTask actions) is stable across processes.
    remaining = {node_id: len(node.depends_on) for node_id, node in nodes.items()}
    dependents: dict[str, list[str]] = {node_id: [] for node_id in nodes}
    for node in nodes.values():
        for dep in node.depends_on:
            dependents[dep].append(node.id)
    position = {node_id: i for i, node_id in enumerate(nodes)}
    ready = sorted((n for n, count in remaining.items() if count == 0), key=position.__getitem__)
    order: list[str] = []
    while ready:
        node_id = ready.pop(0)
        order.append(node_id)
        for dependent in dependents[node_id]:
            remaining[dependent] -= 1
            if remaining[dependent] == 0:
                ready.append(dependent)
                ready.sort(key=position.__getitem__)
    if len(order) != len(nodes):
        raise Invalid("workflow: dependency cycle")
    return tuple(order)


def find_cycle(nodes: Mapping[str, NodeSpec]) -> list[str] | None:
    # Iterative DFS with colours; the grey stack is the path, so the cycle is the
    # stretch of it from the node we meet again.
    colour: dict[str, int] = {}
    for start in nodes:
        if colour.get(start):
            continue
        path: list[str] = []
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            node_id, i = stack.pop()
            if i == 0:
                colour[node_id] = 1
                path.append(node_id)
            deps = nodes[node_id].depends_on
            if i < len(deps):
                stack.append((node_id, i + 1))
                dep = deps[i]
                if colour.get(dep) == 1:
                    cycle = path[path.index(dep) :]
                    return [*cycle, dep]
                if not colour.get(dep):
                    stack.append((dep, 0))
            else:
                colour[node_id] = 2
                path.pop()
    return None


def ancestors(nodes: Mapping[str, NodeSpec], order: tuple[str, ...]) -> dict[str, set[str]]:
    ancestors: dict[str, set[str]] = {}
    for node_id in order:
        found: set[str] = set()
        for dep in nodes[node_id].depends_on:
            found.add(dep)
            found |= ancestors[dep]
        ancestors[node_id] = found
    return ancestors
