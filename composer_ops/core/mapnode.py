"""MAP nodes in the state machine: one task per item, at most ``max_parallel`` in flight.

A MAP node's own task is WAITING while its items run and carries the node's counters
(:class:`~composer_ops.core.model.ItemCounts`). Every item's task is created with the
node, PENDING, and dispatched in item order as earlier items finish, so an event on an
item reads the counters (in the snapshot), that one item (``Store.load_item``) and
nothing else; the item outputs are read once, in item order, when the last item
finishes (``Store.item_outputs``), and the node fails if, assembled, they exceed the
limit of one JSON document (:data:`~composer_ops.core.jsonsize.MAX_BYTES`). A worker's
handler receives the node's resolved ``input`` object with ``"item"`` (the list
element) and ``"index"`` (its 0-based position) added.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from composer_ops.core import model
from composer_ops.core.expressions import parse_ref, referenced_nodes, resolve, resolve_ref
from composer_ops.core.jsonsize import MAX_BYTES, json_size
from composer_ops.core.model import ItemCounts, ItemState, NodeType, TaskRef, TaskState
from composer_ops.core.spec import NodeSpec

if TYPE_CHECKING:
    from composer_ops.core.machine import Decider

__all__ = ["MAX_ITEMS", "cancel_items", "create_map", "item_finished", "item_input", "item_of"]

#: The most items one MAP node takes: every item is a task row written in one transaction.
MAX_ITEMS = 100_000


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an object" if isinstance(value, dict) else type(value).__name__


def item_input(base: Any, item: Any, index: int) -> dict[str, Any]:
    """What an item's handler receives: the node's resolved ``input`` object with
    ``item`` and ``index`` set (a non-object ``input`` is kept under ``"input"``)."""
    fields = dict(base) if isinstance(base, dict) else ({} if base is None else {"input": base})
    return {**fields, "item": item, "index": index}


def create_map(d: Decider, node: NodeSpec) -> None:
    """Create a MAP node that became ready: its items resolved, a task per item, the
    first ``max_parallel`` dispatched. Items that are not a list fail the node."""
    assert node.items is not None
    ref = parse_ref(node.items)
    value = resolve_ref(ref, d.run.context, d.outputs_of([ref.node] if ref.node is not None else []))
    error = None
    if not isinstance(value, list):
        error = f"items {node.items} resolved to {_kind(value)}, not a list"
    elif len(value) > MAX_ITEMS:
        error = f"items {node.items} resolved to a list of {len(value)} items; a MAP node takes at most {MAX_ITEMS}"
    if error is not None:
        d.create(node, TaskState.FAILED, error=error)
        d.node_failed(node.id, f"node {json.dumps(node.id)} failed: {error}")
        return
    assert isinstance(value, list)
    if not value:
        d.create(node, TaskState.COMPLETED, output=[], items=ItemCounts(total=0))
        return
    base = resolve(node.input, d.run.context, d.outputs_of(referenced_nodes(node.input)))
    first = min(node.max_parallel, len(value))
    d.create(node, TaskState.WAITING, queue=node.queue, items=ItemCounts(total=len(value), started=first))
    d.actions.append(model.CreateItems(
        node_id=node.id, parent=d.slots[node.id].task_id, task_ids=tuple(d.new_id() for _ in value),
        inputs=tuple(item_input(base, item, i) for i, item in enumerate(value)), state=TaskState.PENDING,
        dispatch=first, available_at=d.now))


def item_of(d: Decider, ref: TaskRef) -> ItemState | None:
    """The item of a MAP node that ``ref`` names (None: the node is no MAP or has no
    such item), loaded once per decision."""
    node = d.spec.nodes.get(ref.node_id)
    if node is None or node.type is not NodeType.MAP:
        return None
    found = d.items.get(ref.task_id)
    if found is None:
        found = d.store.load_item(ref.node_id, ref.task_id)
        if found is not None:
            d.items[ref.task_id] = found
    return found


def item_finished(d: Decider, item: ItemState, node_id: str, *, output: Any = None, error: str | None = None) -> None:
    """An item completed (``error`` None) or failed for good: count it, dispatch the
    next item, and finish the node when it was the last one (or, with
    ``on_item_failure: "fail"``, when it failed)."""
    node = d.spec.nodes[node_id]
    slot = d.slots[node_id]
    counts = slot.items
    if slot.state is not TaskState.WAITING or counts is None:
        return      # the node already ended (an earlier item failed it); the item is counted nowhere
    if error is None:
        counts = dataclasses.replace(counts, done=counts.done + 1)
    else:
        counts = dataclasses.replace(counts, failed=counts.failed + 1)
        if node.on_item_failure == "fail":
            reason = f"item {item.index} failed: {error}"
            d.actions.append(model.CountItems(node_id=node_id, parent=slot.task_id, items=counts))
            d.actions.append(model.CancelItems(node_id=node_id, reason=f"node {json.dumps(node_id)} failed: {reason}"))
            d.actions.append(model.FinishMap(node_id=node_id, parent=slot.task_id, state=TaskState.FAILED,
                                             reason=reason))
            d.set_state(node_id, TaskState.FAILED, items=counts)
            d.node_failed(node_id, f"node {json.dumps(node_id)} failed: {reason}")
            return
    nxt: tuple[int, ...] = ()
    if counts.started < counts.total:
        nxt = (counts.started,)
        counts = dataclasses.replace(counts, started=counts.started + 1)
    d.actions.append(model.CountItems(node_id=node_id, parent=slot.task_id, items=counts))
    if nxt:
        d.actions.append(model.DispatchItems(node_id=node_id, indexes=nxt, available_at=d.now))
    if counts.finished < counts.total:
        d.update(node_id, items=counts)
        return
    outputs = list(d.store.item_outputs(node_id))
    if error is None:
        outputs[item.index] = output        # its own completion is written after this decision
    # Each item's output is within the limit (a handler's larger one fails its item); all
    # of them together need not be, and are refused here rather than stored.
    size = json_size(outputs)
    if size > MAX_BYTES:
        reason = (f"the assembled output of node {json.dumps(node_id)} is {size} bytes of JSON; "
                  f"the limit is {MAX_BYTES}")
        d.actions.append(model.FinishMap(node_id=node_id, parent=slot.task_id, state=TaskState.FAILED,
                                         reason=reason))
        d.set_state(node_id, TaskState.FAILED, items=counts)
        d.node_failed(node_id, f"node {json.dumps(node_id)} failed: {reason}")
        return
    d.actions.append(model.FinishMap(node_id=node_id, parent=slot.task_id, state=TaskState.COMPLETED,
                                     output=outputs))
    d.set_state(node_id, TaskState.COMPLETED, output=outputs, items=counts)


def cancel_items(d: Decider, node_id: str, reason: str) -> None:
    """Cancel a MAP node's items with the node: those of a node created in this same
    decision are created CANCELLED instead (they never existed as active)."""
    for i, action in enumerate(d.actions):
        if isinstance(action, model.CreateItems) and action.node_id == node_id:
            d.actions[i] = dataclasses.replace(action, state=TaskState.CANCELLED, dispatch=0, available_at=None)
            return
    d.actions.append(model.CancelItems(node_id=node_id, reason=reason))
