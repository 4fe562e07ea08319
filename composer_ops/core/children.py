"""SUB_WORKFLOW nodes in the state machine: a child run per node, the parent waits.

The node is created WAITING and its child is started in the same transaction
(``StartChild``) as ``child_run_id(run, node, created_at)``: a UUIDv7 whose time is the
instant the node was created (the database clock of that decision) and whose other bits
come from the parent run and the node, so the child's ID is known from the parent's
own rows, and a second start of it is a conflict, never a second child. The child's
finish reaches the parent as :class:`~composer_ops.core.model.ChildFinished`, under
the parent's run lock; cancelling or failing the parent cancels its active children.
Which child workflows a definition may name (it exists, no cycle back to it) is
decided at deploy time against the stored definitions (:func:`child_cycle`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING

from composer_ops.core import model
from composer_ops.core.expressions import referenced_nodes, resolve
from composer_ops.core.model import NodeType, RunStatus, TaskState
from composer_ops.core.spec import NodeSpec, WorkflowSpec

if TYPE_CHECKING:
    from composer_ops.core.machine import Decider

__all__ = ["cancel_child", "child_cycle", "child_finished", "child_run_id", "children_of", "create_child"]


def child_run_id(parent_run_id: str, node_id: str, at: datetime) -> str:
    """The run ID of the child a SUB_WORKFLOW node created at ``at`` starts: a
    canonical lowercase UUIDv7 with ``at``'s millisecond and 74 bits of
    SHA-256(parent run, node)."""
    ms = int(at.timestamp() * 1000)
    digest = int.from_bytes(hashlib.sha256(f"{parent_run_id}/{node_id}".encode()).digest()[:10], "big")
    rand_a, rand_b = digest >> 68 & 0xFFF, digest & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def children_of(spec: WorkflowSpec) -> list[tuple[str, str, int | None]]:
    """(node id, child workflow, version or None) of each SUB_WORKFLOW node of ``spec``."""
    return [(n.id, n.workflow, n.version) for n in spec.nodes.values()
            if n.type is NodeType.SUB_WORKFLOW and n.workflow is not None]


def child_cycle(spec: WorkflowSpec, lookup: Callable[[str, int | None], WorkflowSpec]) -> str | None:
    """Why deploying ``spec`` would let a run start itself again through its children
    (a one-line message naming the node and the chain), or None. ``lookup`` returns a
    stored child's spec (the deployed version for None) and raises for one that does
    not exist; a child that names ``spec``'s own workflow closes a cycle."""
    seen: set[tuple[str, int | None]] = set()

    def walk(children: Iterable[tuple[str, str, int | None]], chain: list[str]) -> str | None:
        for _, workflow, version in children:
            path = [*chain, workflow]
            if workflow == spec.id:
                return " -> ".join(json.dumps(w) for w in path)
            if (workflow, version) in seen:
                continue
            seen.add((workflow, version))
            found = walk(children_of(lookup(workflow, version)), path)
            if found is not None:
                return found
        return None

    for node_id, workflow, version in children_of(spec):
        found = walk([(node_id, workflow, version)], [spec.id])
        if found is not None:
            return f"node {json.dumps(node_id)}: SUB_WORKFLOW cycle {found}"
    return None


def create_child(d: Decider, node: NodeSpec) -> None:
    """Create a SUB_WORKFLOW node that became ready: WAITING, its child started."""
    assert node.workflow is not None
    child_input = resolve(node.input, d.run.context, d.outputs_of(referenced_nodes(node.input)))
    d.create(node, TaskState.WAITING)
    d.actions.append(model.StartChild(node_id=node.id, child_run_id=child_run_id(d.run.id, node.id, d.now),
                                      workflow=node.workflow, version=node.version, input=child_input))


def child_finished(d: Decider, event: model.ChildFinished) -> model.Decision:
    """The node's child finished: its success completes the node with the child's
    output, anything else fails it."""
    node = d.spec.nodes.get(event.node_id)
    slot = d.slots.get(event.node_id)
    if node is None or node.type is not NodeType.SUB_WORKFLOW or slot is None:
        return model.Decision(actions=(model.Stale(reason=f"run {d.run.id} has no SUB_WORKFLOW node "
                                                          f"{json.dumps(event.node_id)} waiting"),))
    expected = child_run_id(d.run.id, node.id, slot.created_at or d.now)
    if slot.state is not TaskState.WAITING or expected != event.child_run_id:
        return model.Decision(actions=(model.Stale(reason=f"node {json.dumps(node.id)} is {slot.state} and waits "
                                                          f"for no child {event.child_run_id}"),))
    if event.status is RunStatus.SUCCEEDED:
        d.actions.append(model.FinishChild(node_id=node.id, parent=slot.task_id, state=TaskState.COMPLETED,
                                           output=event.output))
        d.set_state(node.id, TaskState.COMPLETED, output=event.output)
    else:
        why = f": {event.error}" if event.error else ""
        # A child that could not start has no run to name: its ID would lead nowhere.
        reason = f"child run {event.child_run_id} {event.status}{why}" if event.started else \
            f"its child {event.error or 'did not start'}"
        d.actions.append(model.FinishChild(node_id=node.id, parent=slot.task_id, state=TaskState.FAILED,
                                           reason=reason))
        d.set_state(node.id, TaskState.FAILED)
        d.node_failed(node.id, f"node {json.dumps(node.id)} failed: {reason}")
    d.advance()
    return d.decision()


def cancel_child(d: Decider, node_id: str, reason: str) -> None:
    """Cancel a SUB_WORKFLOW node's child with the node; a child this same decision
    would have started is not started at all."""
    for i, action in enumerate(d.actions):
        if isinstance(action, model.StartChild) and action.node_id == node_id:
            del d.actions[i]
            return
    slot = d.slots[node_id]
    d.actions.append(model.CancelChild(node_id=node_id, reason=reason,
                                       child_run_id=child_run_id(d.run.id, node_id, slot.created_at or d.now)))
