"""Odd data the reports show and flag instead of failing on it.

A report fails only when the database cannot be read. Rows that break what the
engine guarantees (a RUNNING task without a lease, a task for a node its definition
does not have, a run whose definition version is gone, a partition whose bounds do
not match its name) are listed as :class:`~composer_ops.ops.display.Anomaly` with
what to do about each.
"""

from __future__ import annotations

import polars as pl

from composer_ops.db.loaders import INFINITY, MINUS_INFINITY
from composer_ops.ops.display import Anomaly


def _where(run_id: str | None, node_id: str | None = None) -> str:
    return f"run {run_id}" + (f", node {node_id}" if node_id else "")


def leases(without_lease: pl.DataFrame) -> list[Anomaly]:
    """RUNNING tasks without a lease, or with an infinite one (from
    :func:`composer_ops.ops.leases.without_lease`)."""
    out = []
    for run, node, attempt, owner, expiry in without_lease.select(
            "run_id", "node_id", "attempt", "lease_owner", "lease_expires_at").iter_rows():
        if expiry in (INFINITY, MINUS_INFINITY):
            never = expiry == INFINITY
            out.append(Anomaly(
                kind="RUNNING with an infinite lease", subject=_where(run, node),
                detail=f"attempt {attempt}, owner {owner or '(none)'}, lease expiry "
                       f"{'infinity' if never else '-infinity'}: the engine never writes one (a hand edit?); "
                       + ("the lease never lapses, so if its worker dies the sweeper never re-queues the task"
                          if never else "the sweeper takes it for a lease that expired before any worker held it"),
                action="open it with run_investigation, then cancel the run (composer-ops cancel RUN)"))
            continue
        out.append(Anomaly(
            kind="RUNNING without a lease", subject=_where(run, node),
            detail=f"attempt {attempt}, owner {owner or '(none)'}, lease expiry {'set' if expiry else '(none)'}: "
                   "no worker heartbeats it and the lease sweeper never expires it, so it stays RUNNING",
            action="open it with run_investigation, then cancel the run (composer-ops cancel RUN)"))
    return out


def partitions(inventory: pl.DataFrame) -> list[Anomaly]:
    """Partitions whose declared bounds do not decode to the month in their name."""
    bad = inventory.filter(~pl.col("bounds_match"))
    out = []
    for table, name, month, lower, upper in bad.select("table", "partition", "month", "lower_at",
                                                       "upper_at").iter_rows():
        shown = (f"[{lower:%Y-%m-%d %H:%M}, {upper:%Y-%m-%d %H:%M}) UTC"
                 if lower is not None and upper is not None else "bounds that are not UUIDv7 month edges")
        out.append(Anomaly(
            kind="partition bounds do not match its name", subject=f"{table} partition {name}",
            detail=f"named for month {month or '(none)'} but holds {shown}: runs of that month may be refused "
                   "or land in the wrong partition, and retention reasons about the wrong month",
            action="run composer-ops migrate (it repairs misaligned bounds), then re-run this report"))
    return out


def _missing_version(run_id: str | None, workflow: str | None, version: int | None, seen: str = "",
                     action: str = "restore that version's definition row (its spec_json) or cancel the run",
                     ) -> Anomaly:
    return Anomaly(
        kind="definition version missing", subject=_where(run_id),
        detail=f"the run started on {workflow} v{version}, which is not in workflow_definitions{seen}: "
               "the coordinator cannot load it to decide the next step",
        action=action)


def _unknown_node(run_id: str | None, node: str | None, workflow: str | None, version: int | None,
                  seen: str = "", action: str = "compare the definition version with the code that deployed it; "
                                                 "the graph shows the node apart") -> Anomaly:
    return Anomaly(
        kind="task for a node not in its definition", subject=_where(run_id, node),
        detail=f"{workflow} v{version} has no node {node!r}{seen}: the task was written by other code or "
               "the definition row was changed after the run started",
        action=action)


def run(spec_found: bool, workflow: str, version: int, unknown_nodes: list[str], run_id: str) -> list[Anomaly]:
    """A run whose definition version is missing (then its nodes are not judged: each
    would read as missing from it), or its tasks for nodes its definition lacks."""
    if not spec_found:
        return [_missing_version(run_id, workflow, version)]
    return [_unknown_node(run_id, node, workflow, version) for node in unknown_nodes]


def definitions(mismatches: pl.DataFrame) -> list[Anomaly]:
    """Active runs whose definition version is missing, active tasks for nodes their
    run's definition lacks, and active tasks of a run whose row is gone (from
    :func:`composer_ops.ops.active.definition_mismatches`: a row without ``status`` has
    no run, one without ``node_id`` is the run's own)."""
    out = []
    for run_id, workflow, version, status, node, tasks, states in mismatches.select(
            "run_id", "workflow_id", "workflow_version", "status", "node_id", "tasks", "states").iter_rows():
        seen = f" ({tasks} active task{'' if tasks == 1 else 's'}: {states}; run {status})"
        if status is None:
            out.append(Anomaly(
                kind="active tasks of a run that does not exist", subject=_where(run_id),
                detail=f"{tasks} active task{'' if tasks == 1 else 's'} ({states}) whose workflow_runs row is gone: "
                       "no event of theirs can be decided (the engine loads the run first), so they stay active",
                action="find how the run row went (a DELETE by hand: no key holds a task to its run); put the "
                       "row back, or delete the run's task rows and their outbox rows"))
        elif node is None:
            out.append(_missing_version(run_id, workflow, version, seen,
                                        "open it with run_investigation; restore that version's definition row "
                                        "(its spec_json) or cancel the run (composer-ops cancel RUN)"))
        else:
            out.append(_unknown_node(run_id, node, workflow, version, seen,
                                     "open it with run_investigation (the graph shows the node apart); compare the "
                                     "definition version with the code that deployed it, or cancel the run"))
    return out


def map_items(run_id: str, disagreements: list[tuple[str, str]]) -> list[Anomaly]:
    """MAP nodes whose counters disagree with their item rows
    (:func:`composer_ops.ops.investigation.map_disagreements`)."""
    return [Anomaly(
        kind="MAP counters disagree with its items", subject=_where(run_id, node),
        detail=f"{what}: the engine decides when the node ends from its counters, so it may end early, "
               "or never",
        action="compare the items with the node's counters (the MAP items section); cancel the run, or retry it "
               "from this node (composer-ops runs retry RUN --from NODE)")
        for node, what in disagreements]
