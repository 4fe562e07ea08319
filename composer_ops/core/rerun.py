"""Retrying a finished run: which nodes run again, as one decision of the machine."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import TYPE_CHECKING

from composer_ops.core import model
from composer_ops.core.model import TERMINAL_RUN_STATUSES, Decision, RunStatus, TaskState
from composer_ops.core.spec import WorkflowSpec
from composer_ops.errors import Conflict, Invalid

if TYPE_CHECKING:
    from composer_ops.core.machine import Decider

__all__ = ["retry_run"]


def retry_run(d: Decider, event: model.RetryRun) -> Decision:
    """Reopen a FAILED or CANCELLED run and run part of it again.

    The nodes that run again are the ``from_nodes`` (default: the nodes that failed,
    other than optional ones) and every node downstream of them, whatever their
    state, plus the nodes whose tasks were cancelled when the run ended and every
    node downstream of those. Their tasks are removed; every other node keeps its
    task and output. Then the nodes that are ready are created as usual. A node that
    failed the run and would not run again is refused: the run would go on as if it
    had not failed. A child run (SUB_WORKFLOW) whose parent is FAILED or CANCELLED is
    refused: the parent is retried from the node, with a new child.
    """
    run, spec = d.run, d.spec
    if run.status not in TERMINAL_RUN_STATUSES:
        raise Conflict(f"run {run.id} is {run.status}: only a FAILED or CANCELLED run can be retried "
                       "(cancel it first)")
    if run.status is RunStatus.SUCCEEDED:
        raise Conflict(f"run {run.id} SUCCEEDED: only a FAILED or CANCELLED run can be retried")
    if run.parent_run_id is not None and event.parent_status in (RunStatus.FAILED, RunStatus.CANCELLED):
        # Its parent took its finish and ended: a child run again would finish unseen, and
        # the parent's own retry would start another child and run the same work twice.
        # (A parent that went on, its node optional, or that is gone, leaves the child's
        # retry the only way to run its work again.)
        raise Conflict(f"run {run.id} is the child of run {run.parent_run_id} (node "
                       f"{json.dumps(run.parent_node_id)}), which is {event.parent_status}: retry the parent from "
                       f"that node, which starts a new child (composer-ops runs retry {run.parent_run_id} --from "
                       f"{run.parent_node_id})")
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
