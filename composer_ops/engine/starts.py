"""The one start path: a run inserted and its first decision, in the caller's transaction.

``Engine.start`` calls it in a transaction of its own; the shell calls it for a
SUB_WORKFLOW node's child, inside the parent's decision, so the parent's node and its
child commit together or not at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_ops.core.runids import validate_run_id
from composer_ops.engine.ids import uuid7_at
from composer_ops.engine.requests import Request
from composer_ops.errors import Invalid
from composer_ops.repo import definitions, partitions, runs
from composer_ops.repo._base import Conn
from composer_ops.repo.rows import RunRow

if TYPE_CHECKING:
    from composer_ops.engine.shell import Shell

__all__ = ["start_in"]


def start_in(conn: Conn, shell: Shell, *, workflow_id: str, version: int | None, input: Any,
             run_id: str | None, minted: list[str], request: Request,
             parent: tuple[str, str] | None = None, started_detail: Any = None,
             derived: bool = False) -> tuple[str, int]:
    """Insert a run of the deployed (or the given) version and apply its StartRun
    decision; returns ``(run_id, version)``. ``run_id`` None mints one from the
    database clock into ``minted`` (kept across the caller's retries); a given one is
    checked for recency and partition, or, ``derived`` (a schedule slot's ID, stamped
    with the slot's instant), for its partition only. ``parent``: the run and node
    starting it; ``started_detail`` goes into the run's 'started' history row. A taken
    run ID is a :class:`Conflict` that leaves the caller's transaction usable."""
    # The clock and the definition in one statement; a missing definition is
    # refused after the run ID checks, in the order they always ran.
    now, row = definitions.clock_and_start_target(conn, workflow_id, version)
    if run_id is None:
        if not minted:
            minted.append(uuid7_at(now))
        run_id = minted[0]
    else:
        if not derived:
            validate_run_id(run_id, now)
        partitions.require_run_partition(conn, run_id)
    if row is None:
        definitions.refuse_missing(conn, workflow_id, version)
    if row.deleted_at is not None:
        raise Invalid(f"workflow {workflow_id!r} v{row.version} has been deleted; it accepts no new runs")
    if not row.enabled:
        raise Invalid(f"workflow {workflow_id!r} is disabled; it accepts no new runs")
    spec = shell.definition(conn, row.id, row.version).spec
    context = {"input": input, "config": dict(spec.config)}
    runs.insert_run(conn, run_id=run_id, workflow_id=row.id, workflow_version=row.version, input=input,
                    context=context, now=now, request=request.id, parent=parent,
                    started_detail=started_detail)
    # The insert holds the new row's lock until commit; no need to lock again.
    shell.start_decision(conn, RunRow(id=run_id, workflow_id=row.id, workflow_version=row.version,
                                      status="RUNNING", context=context, now=now,
                                      parent_run_id=parent[0] if parent else None,
                                      parent_node_id=parent[1] if parent else None), request)
    return run_id, row.version
