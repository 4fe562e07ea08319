"""WAIT_FOR_SIGNAL nodes in the state machine: waiters, buffered signals, delivery.

A signal resolves exactly one node: the earliest-created node WAITING for its name,
else it is buffered and consumed, oldest first, by the next waiter the run creates.
Timeouts are judged by the database clock of the event (``Decider.now``).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from composer_ops.core import model
from composer_ops.core.model import ACTIVE_RUN_STATUSES, Decision, NodeType, Signal, TaskState
from composer_ops.core.spec import NodeSpec
from composer_ops.errors import Conflict, Invalid

if TYPE_CHECKING:
    from composer_ops.core.machine import Decider

__all__ = ["create_waiter", "signal_received"]

_EARLIEST = datetime.min.replace(tzinfo=UTC)


def create_waiter(d: Decider, node: NodeSpec) -> None:
    """Create a WAIT_FOR_SIGNAL node: COMPLETED by a buffered signal of its name, else WAITING."""
    assert node.signal_name is not None
    signal = d.take_signal(node.signal_name)
    if signal is not None:
        d.create(node, TaskState.COMPLETED, output=signal.payload, signal_name=node.signal_name)
        d.actions.append(model.ConsumeSignal(signal_id=signal.id))
        return
    wake_at = None if node.timeout_s is None else d.now + timedelta(seconds=node.timeout_s)
    d.create(node, TaskState.WAITING, wake_at=wake_at, signal_name=node.signal_name)


def signal_received(d: Decider, event: model.SignalReceived) -> Decision:
    """Resolve the earliest-created node waiting for the signal, else buffer it.

    Timeouts are judged by the database clock now, not by whether the timer loop
    has run: a waiter whose timeout has passed is resolved as its timer would
    resolve it, and the signal goes on to the next waiter. A signal that is buffered
    is available to nodes this decision creates (a waiter behind a timed-out node).
    """
    run = d.run
    if run.status not in ACTIVE_RUN_STATUSES:
        raise Conflict(f"run {run.id} is {run.status}; it accepts no signals")
    nodes = d.spec.nodes.values()
    if not any(n.type is NodeType.WAIT_FOR_SIGNAL and n.signal_name == event.name for n in nodes):
        raise Invalid(
            f"run {run.id}: workflow {json.dumps(run.workflow_id)} version {run.workflow_version} "
            f"has no WAIT_FOR_SIGNAL node for signal {json.dumps(event.name)}"
        )
    waiters = sorted(
        (
            (slot.created_at or _EARLIEST, slot.task_id, node_id)
            for node_id, slot in d.slots.items()
            if slot.state is TaskState.WAITING
            and slot.signal_name == event.name
            and node_id in d.spec.nodes
            and d.spec.nodes[node_id].type is NodeType.WAIT_FOR_SIGNAL
        ),
    )
    for _, task_id, node_id in waiters:
        slot = d.slots[node_id]
        if slot.wake_at is not None and slot.wake_at <= d.now:
            d.wake(d.spec.nodes[node_id])
            if d.finished:
                d.refused = (f"run {run.id} failed before the signal {json.dumps(event.name)} arrived: "
                                f"node {json.dumps(node_id)} timed out at {slot.wake_at.isoformat()}")
                return d.decision()
            continue
        d.actions.append(
            model.ResolveWait(task_id=task_id, node_id=node_id, state=TaskState.COMPLETED, output=event.payload)
        )
        d.set_state(node_id, TaskState.COMPLETED, output=event.payload)
        break
    else:
        signal = Signal(id=d.new_id(), name=event.name, payload=event.payload)
        buffer_at = len(d.actions)
        d.actions.append(model.BufferSignal(signal_id=signal.id, name=signal.name, payload=signal.payload))
        d.buffered(event.name).append(signal)
        d.advance()
        if d.finished and signal.id not in d.consumed:
            # The timeouts resolved above finished the run: by the database clock it
            # was over before the signal arrived, so the signal is not kept.
            del d.actions[buffer_at]
            finish = d.decision().finish
            status = finish.status if finish is not None else "finished"
            d.refused = (f"run {run.id} was {status} before the signal {json.dumps(event.name)} "
                            "arrived: its waiters had timed out")
        return d.decision()
    d.advance()
    return d.decision()
