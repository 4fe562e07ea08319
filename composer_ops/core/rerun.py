"""Retrying a finished run: which nodes run again, as one decision of the machine."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import TYPE_CHECKING

from composer_ops.core import model
from composer_ops.core.model import ACTIVE_RUN_STATUSES, TERMINAL_RUN_STATUSES, Decision, RunStatus, TaskState
from composer_ops.core.spec import WorkflowSpec
from composer_ops.errors import Conflict, Invalid

if TYPE_CHECKING:
    from composer_ops.core.machine import Decider

__all__ = ["child_left_to_parent", "retry_run"]


def retry_run(d: Decider, event: model.RetryRun) -> Decision:
    """Reopen a FAILED or CANCELLED run and run part of it again.

    The nodes that run again are the ``from_nodes`` (default: the nodes that failed,
    other than optional ones) and every node downstream of them, whatever their
    state, plus the nodes whose tasks were cancelled when the run ended and every
    node downstream of those. Their tasks are removed; every other node keeps its
    task and output. Then the nodes that are ready are created as usual. A node that
    failed the run and would not run again is refused: the run would go on as if it
    had not failed. A child run (SUB_WORKFLOW) is refused where its parent's retry
    is the way to run its work again (:func:`child_left_to_parent`).
    """
    run, spec = d.run, d.spec
    if run.status not in TERMINAL_RUN_STATUSES:
        raise Conflict(f"run {run.id} is {run.status}: only a FAILED or CANCELLED run can be retried "
                       "(cancel it first)")
    if run.status is RunStatus.SUCCEEDED:
        raise Conflict(f"run {run.id} SUCCEEDED: only a FAILED or CANCELLED run can be retried")
    if run.parent_run_id is not None and run.parent_node_id is not None:
        why = child_left_to_parent(run.id, run.parent_run_id, run.parent_node_id, event.parent_status,
                                   event.parent_child, waits=event.parent_waits)
        if why is not None:
            raise Conflict(why)
    unknown = [n for n in event.from_nodes if n not in spec.nodes]
    if unknown:
        raise Invalid(f"run {run.id}: workflow {json.dumps(run.workflow_id)} version {run.workflow_version} "
                      f"has no node {json.dumps(unknown[0])} (its nodes: {', '.join(spec.nodes)})")
    failed = {n for n, s in d.slots.items()
              if s.state is TaskState.FAILED and n in spec.nodes and not spec.nodes[n].optional}
    seeds = set(event.from_nodes) if event.from_nodes else set(failed)
    seeds |= {n for n, s in d.slots.items() if s.state is TaskState.CANCELLED and n in spec.nodes}
    if not seeds:
        raise Conflict(f"run {run.id} is {run.status} with no failed or cancelled node: "
                       "give the node to run again from")
    again = _downstream(spec, seeds)
    left = sorted(failed - again)
    if left:
        raise Invalid(f"run {run.id}: node {json.dumps(left[0])} failed the run and does not run again from "
                      f"{', '.join(json.dumps(n) for n in sorted(event.from_nodes))}: retry from it too "
                      "(or without a node)")
    reset = sorted(n for n in again if n in d.slots)
    if reset:
        d.actions.append(model.ResetTasks(task_ids=tuple(d.slots[n].task_id for n in reset),
                                    node_ids=tuple(reset)))
    d.actions.append(model.ReopenRun(status=run.status))
    for node_id in reset:
        del d.slots[node_id]
        d.outputs.pop(node_id, None)
    d.advance()
    return d.decision()


def _downstream(spec: WorkflowSpec, seeds: Collection[str]) -> set[str]:
    """``seeds`` and every node that depends on one of them, transitively."""
    found = set(seeds)
    for node_id in spec.topological_order():
        if any(dep in found for dep in spec.nodes[node_id].depends_on):
            found.add(node_id)
    return found


def child_left_to_parent(run_id: str, parent_run_id: str, parent_node_id: str, parent_status: str | None,
                         parent_child: str | None, *, waits: bool = False) -> str | None:
    """Why a SUB_WORKFLOW child run may not be retried on its own, or None when it may.
    ``parent_status`` is its parent's status (None: the parent is gone, and the child's
    retry is the only way to run its work again); ``parent_child`` the child run the
    parent's node stands for now (None: the node has no task).

    Refused: a parent FAILED or CANCELLED took the child's finish and ended, so the
    child run again would finish unseen, and the parent's own retry would start another
    child and run the same work twice; a parent whose node stands for another child
    (a retry of the parent started it) or for none (it is to start one) has the work
    in hand; a parent whose node still waits for this child (``waits``: on Citus its
    finish may not have been delivered yet) is about to take the finish, and then it is
    the parent's retry that runs the work again; a parent that went on without the child
    (its node optional) and is still active: cancelling or failing it cancels only the
    children its active nodes stand for, and its retry from the node would start another
    child, so the child run again would be left running beside it (the work twice).
    Left: a parent that went on without the child and has ended SUCCEEDED, or is gone,
    where the child's retry finishes unseen but is the only way to run its work again."""
    node = json.dumps(parent_node_id)
    if parent_status in (RunStatus.FAILED, RunStatus.CANCELLED):
        return (f"run {run_id} is the child of run {parent_run_id} (node {node}), which is {parent_status}: "
                f"retry the parent from that node, which starts a new child (composer-ops runs retry "
                f"{parent_run_id} --from {parent_node_id})")
    if parent_status is not None and parent_child == run_id and waits:
        return (f"run {run_id} is the child of run {parent_run_id} (node {node}), whose node still waits for its "
                f"finish (on its way to the parent): retry once the parent has it (composer-ops runs show "
                f"{parent_run_id})")
    if parent_status is not None and parent_child != run_id:
        now = f"run {parent_child} now" if parent_child is not None else "no child yet (it starts a new one)"
        return (f"run {run_id} is the child of run {parent_run_id} (node {node}), which is {parent_status} "
                f"and whose node stands for {now}: a retry of this child would run the node's work twice")
    if parent_status in ACTIVE_RUN_STATUSES:
        return (f"run {run_id} is the child of run {parent_run_id} (node {node}), which went on without it and "
                f"is {parent_status}: retry this child once the parent has ended, so that cancelling, failing or "
                f"retrying the parent cannot leave it running unseen (composer-ops runs show {parent_run_id})")
    return None
