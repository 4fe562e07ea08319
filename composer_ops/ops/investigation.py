"""One run's story: its definition graph, every task with its timings (a Gantt
chart's data), attempts and errors, waits, buffered and consumed signals, the
current lease of each task, pending dispatches and the webhook delivery; and its
history (``run_history``), from which every attempt of every task is read, with the
worker that ran it and how it ended (:mod:`composer_ops.core.attempts`).

The run ID is validated as a UUID before any query. Every query filters on the run
ID, so each touches the single monthly partition that holds the run.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import polars as pl

from composer_ops.core import runids
from composer_ops.core.attempts import HistoryRow
from composer_ops.core.attempts import attempts as attempts_of
from composer_ops.core.model import RunStatus
from composer_ops.errors import Invalid, NotFound
from composer_ops.ops._common import ACTIVE_STATES, UTC_TS, Source, connection, rows_frame
from composer_ops.repo import analytics

TASK_SCHEMA = {
    "task_id": pl.String, "node_id": pl.String, "node_type": pl.String, "queue": pl.String, "state": pl.String,
    "attempt": pl.Int64, "created_at": UTC_TS, "started_at": UTC_TS, "finished_at": UTC_TS, "updated_at": UTC_TS,
    "queued_s": pl.Float64, "ran_s": pl.Float64, "wake_at": UTC_TS, "wakes_in_s": pl.Float64,
    "signal_name": pl.String, "lease_owner": pl.String, "lease_expires_at": UTC_TS, "lease_left_s": pl.Float64,
    "last_error": pl.String, "branches": pl.List(pl.String), "output": pl.String,
}

ITEM_STATES_SCHEMA = {"node_id": pl.String, "state": pl.String, "items": pl.Int64}
MAP_NODES_SCHEMA = {"node_id": pl.String, "state": pl.String, "items_total": pl.Int64, "items_started": pl.Int64,
                    "items_done": pl.Int64, "items_failed": pl.Int64}
SLOWEST_SCHEMA = {
    "node_id": pl.String, "item_index": pl.Int64, "state": pl.String, "attempt": pl.Int64, "started_at": UTC_TS,
    "finished_at": UTC_TS, "ran_s": pl.Float64,
}
LINKS_SCHEMA = {"link": pl.String, "node_id": pl.String, "run_id": pl.String, "workflow_id": pl.String,
                "status": pl.String}

HISTORY_SCHEMA = {
    "seq": pl.Int64, "at": UTC_TS, "kind": pl.String, "node_id": pl.String, "task_id": pl.String,
    "attempt": pl.Int64, "worker": pl.String, "request": pl.String, "detail": pl.String,
}

ATTEMPTS_SCHEMA = {
    "node_id": pl.String, "task_id": pl.String, "retry": pl.Int64, "attempt": pl.Int64, "worker": pl.String,
    "claimed_at": UTC_TS,
    "ended_at": UTC_TS, "ran_s": pl.Float64, "outcome": pl.String, "requeued": pl.Boolean, "error": pl.String,
    "lost": pl.String,
}


def _history_frame(rows: list[Any]) -> pl.DataFrame:
    return rows_frame(rows, HISTORY_SCHEMA)


def attempts_frame(history: pl.DataFrame) -> pl.DataFrame:
    """Every attempt of every task that ``history`` (a run's :data:`HISTORY_SCHEMA`
    frame) records, in the order they began: the worker, when it claimed and when the
    attempt ended, how (completed, failed, lease expired, cancelled, or still
    running), whether the task was re-queued, the error, and the worker's own note of
    a lost lease. ``retry`` is the run's retry generation the attempt began in (0
    before any ``runs retry``): a retried node's attempts count from 0 again."""
    rows = [HistoryRow(**{**r, "detail": json.loads(r["detail"]) if r["detail"] is not None else None})
            for r in history.sort("seq").iter_rows(named=True)]
    found = attempts_of(rows)
    return rows_frame([(a.node_id, a.task_id, a.retry, a.attempt, a.worker, a.claimed_at, a.ended_at,
                        (a.ended_at - a.claimed_at).total_seconds() if a.ended_at and a.claimed_at else None,
                        a.outcome, a.requeued, a.error, a.lost) for a in found], ATTEMPTS_SCHEMA)


#: The notebooks' ``run_id`` parameter: any spelling of a UUIDv7 a person may paste,
#: returned canonical (core's one run-ID check). Called before any query, so a bad
#: notebook parameter never reaches the database.
validate_run_id = functools.partial(runids.validate_run_id, normalise=True, name="run_id")


def latest_run_id(source: Source = None, *, status: str | None = "FAILED") -> str | None:
    """The newest run (run IDs are time-ordered) with ``status`` (any status when
    None), or None when there is none."""
    if status is not None and status not in {s.value for s in RunStatus}:
        raise Invalid(f"unknown run status {status!r}")
    with connection(source) as conn:
        return analytics.latest_run_id(conn, status)


@dataclass(frozen=True, kw_only=True)
class RunStory:
    """Everything the run investigation notebook shows about one run."""

    run: pl.DataFrame
    nodes: pl.DataFrame
    edges: pl.DataFrame
    tasks: pl.DataFrame
    signals: pl.DataFrame
    outbox: pl.DataFrame
    webhook: pl.DataFrame
    #: Whether the run's definition version exists (its graph is drawn from it).
    spec_found: bool = True
    #: The run's history, oldest first (:data:`HISTORY_SCHEMA`).
    history: pl.DataFrame = field(default_factory=lambda: _history_frame([]))
    #: MAP items, collapsed: how many of each node's items are in each state
    #: (:data:`ITEM_STATES_SCHEMA`), and each node's slowest items (:data:`SLOWEST_SCHEMA`).
    item_states: pl.DataFrame = field(default_factory=lambda: rows_frame([], ITEM_STATES_SCHEMA))
    slowest_items: pl.DataFrame = field(default_factory=lambda: rows_frame([], SLOWEST_SCHEMA))
    #: The run's parent and children (SUB_WORKFLOW), :data:`LINKS_SCHEMA`.
    links: pl.DataFrame = field(default_factory=lambda: rows_frame([], LINKS_SCHEMA))
    #: Each MAP node's own row with its counters (:data:`MAP_NODES_SCHEMA`).
    map_nodes: pl.DataFrame = field(default_factory=lambda: rows_frame([], MAP_NODES_SCHEMA))
    #: When ``runs delete`` deleted the run (soft: its rows stay until retention drops its
    #: month, and every command, loop and claim treats it as gone); None for a live run.
    deleted_at: datetime | None = None

    @property
    def deletion(self) -> str | None:
        """For a deleted run, one line saying when and by what (its ``deleted`` history
        row: the status it had, the operator's command and host); None otherwise."""
        if self.deleted_at is None:
            return None
        text = f"deleted at {self.deleted_at:%Y-%m-%d %H:%M:%S} UTC"
        rows = self.history.filter(pl.col("kind") == "deleted")
        if rows.is_empty():
            return text + " (no deleted row in its history: deleted_at was set by hand?)"
        row = rows.row(-1, named=True)
        detail = json.loads(row["detail"]) if row["detail"] else {}
        operator = detail.get("operator") if isinstance(detail, dict) else None
        by = ""
        if isinstance(operator, dict):
            by = f" by `{operator.get('command') or operator.get('action')}`"
            by += f" on {operator['host']}" if operator.get("host") else ""
        status = detail.get("status") if isinstance(detail, dict) else None
        return (f"{text}{by} (history row {row['seq']}"
                + (f"; it was {status}" if status else "") + ")")

    @property
    def map_disagreements(self) -> list[tuple[str, str]]:
        """(node, what differs) for each MAP node whose counters do not match its item
        rows (:func:`map_disagreements`)."""
        return map_disagreements(self.map_nodes, self.item_states)

    @property
    def attempts(self) -> pl.DataFrame:
        """Every attempt of every task (:func:`attempts_frame`)."""
        return attempts_frame(self.history)

    @property
    def unknown_nodes(self) -> list[str]:
        """Nodes that have a task in this run but are not in its definition."""
        return self.nodes.filter(~pl.col("in_definition"))["node_id"].sort().to_list()

    @property
    def run_id(self) -> str:
        return str(self.run["run_id"][0])

    @property
    def status(self) -> str:
        return str(self.run["status"][0])


def run_story(source: Source, run_id: str) -> RunStory:
    """Load one run's story. ``run_id`` is validated first (:class:`Invalid`); a run
    that does not exist is :class:`NotFound`."""
    rid = validate_run_id(run_id)
    with connection(source) as conn:
        run_row = analytics.run_row(conn, rid)
        if run_row is None:
            raise NotFound(f"workflow run {rid} does not exist (or its month's partition was dropped)")
        *fields, deleted_at, spec = run_row
        run = rows_frame([fields], {
            "run_id": pl.String, "workflow_id": pl.String, "workflow_version": pl.Int64, "status": pl.String,
            "created_at": UTC_TS, "updated_at": UTC_TS, "completed_at": UTC_TS, "duration_s": pl.Float64,
            "input": pl.String, "output": pl.String, "error": pl.String, "partition": pl.String,
        })
        tasks = rows_frame(analytics.run_tasks(conn, rid), TASK_SCHEMA)
        signals = rows_frame(analytics.run_signals(conn, rid), {
            "signal_id": pl.String, "name": pl.String, "payload": pl.String, "created_at": UTC_TS,
            "consumed_at": UTC_TS, "status": pl.String, "buffered_s": pl.Float64,
        })
        outbox = rows_frame(analytics.run_outbox(conn, rid), {
            "task_id": pl.String, "queue": pl.String, "attempt": pl.Int64, "task_name": pl.String,
            "lease_s": pl.Int64, "available_at": UTC_TS, "available_in_s": pl.Float64,
        })
        webhook = rows_frame(analytics.run_webhook(conn, rid), {
            "url": pl.String, "attempts": pl.Int64, "next_attempt_at": UTC_TS, "delivered_at": UTC_TS,
            "gave_up_at": UTC_TS, "last_status": pl.Int64, "last_error": pl.String, "created_at": UTC_TS,
        })
        history = _history_frame(analytics.run_history(conn, rid))
        item_states = rows_frame(analytics.run_item_states(conn, rid), ITEM_STATES_SCHEMA)
        slowest = rows_frame(analytics.run_slowest_items(conn, rid), SLOWEST_SCHEMA)
        links = rows_frame(analytics.run_links(conn, rid), LINKS_SCHEMA)
        map_nodes = rows_frame(analytics.run_map_nodes(conn, rid), MAP_NODES_SCHEMA)
    nodes, edges = definition_graph(spec, tasks)
    return RunStory(run=run, nodes=nodes, edges=edges, tasks=tasks, signals=signals, outbox=outbox,
                    webhook=webhook, spec_found=spec is not None, history=history, item_states=item_states,
                    slowest_items=slowest, links=links, map_nodes=map_nodes,
                    deleted_at=deleted_at.astimezone(UTC) if deleted_at is not None else None)


def map_disagreements(map_nodes: pl.DataFrame, item_states: pl.DataFrame) -> list[tuple[str, str]]:
    """(node, what differs) for each MAP node whose counters (``map_nodes``,
    :data:`MAP_NODES_SCHEMA`) disagree with its item rows (``item_states``,
    :data:`ITEM_STATES_SCHEMA`). The engine writes every item with its node and counts
    each item that completes or fails for good in the same transaction, so the
    counters' total, done and failed equal the rows' count, COMPLETED and FAILED
    items; items of a node with no MAP row count as a disagreement too."""
    rows: dict[str, dict[str, int]] = {}
    for node, state, n in item_states.select("node_id", "state", "items").iter_rows():
        rows.setdefault(str(node), {})[str(state)] = int(n)
    found: list[tuple[str, str]] = []
    counted = set()
    for node, _state, total, _started, done, failed in map_nodes.iter_rows():
        counted.add(node)
        have = rows.get(node, {})
        seen = (sum(have.values()), have.get("COMPLETED", 0), have.get("FAILED", 0))
        if total is None:
            if seen[0]:
                found.append((node, f"no counters, {seen[0]} item rows"))
            continue
        said = (total, done or 0, failed or 0)
        if said != seen:
            found.append((node, "counters say {} items, {} done, {} failed; its item rows: {} items, {} COMPLETED, "
                                "{} FAILED".format(*said, *seen)))
    found += [(node, f"{sum(have.values())} item rows and no MAP node row") for node, have in sorted(rows.items())
              if node not in counted]
    return found


def definition_graph(spec: Any, tasks: pl.DataFrame | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Nodes and edges of a stored spec_json. Nodes carry the run's state of each node
    ('NOT REACHED' when it has no task). A task for a node the spec does not have is
    added as a node with ``in_definition`` false and no edges. Edges run from
    dependency to dependant; an edge out of a SWITCH is labelled with the cases that
    select the target."""
    doc = json.loads(spec) if isinstance(spec, str) else (spec or {})
    raw_nodes = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(raw_nodes, list):
        raw_nodes = []
    states: dict[str, tuple[str, int]] = {}
    if tasks is not None:
        states = {n: (s, a) for n, s, a in tasks.select("node_id", "state", "attempt").iter_rows()}
    node_rows: list[tuple[Any, ...]] = []
    edge_rows: list[tuple[str, str, str]] = []
    switch_cases: dict[str, dict[str, list[str]]] = {}
    for i, node in enumerate(raw_nodes):
        if not isinstance(node, dict):
            continue
        nid = str(node.get("id", f"#{i}"))
        ntype = str(node.get("type", "TASK"))
        ntype = "WAIT_FOR_SIGNAL" if ntype == "WAIT_FOR_EVENT" else ntype     # the alias 0.1.0 stored
        if ntype == "SWITCH":
            labels: dict[str, list[str]] = {}
            for case, targets in (node.get("cases") or {}).items():
                for target in targets or []:
                    labels.setdefault(str(target), []).append(f"case {case}")
            for target in node.get("default") or []:
                labels.setdefault(str(target), []).append("default")
            switch_cases[nid] = labels
        state, attempt = states.get(nid, ("NOT REACHED", 0))
        signal = node.get("signal", node.get("event"))      # "event": the key's alias in 0.1.0
        node_rows.append((nid, ntype, node.get("task"), node.get("queue", "default") if ntype == "TASK" else None,
                          signal, [str(d) for d in node.get("depends_on") or []], i, state, attempt))
    known = {row[0] for row in node_rows}
    if tasks is not None:
        for nid, ntype in tasks.select("node_id", "node_type").unique(maintain_order=True).iter_rows():
            if nid not in known:
                state, attempt = states[nid]
                node_rows.append((nid, ntype, None, None, None, [], len(node_rows), state, attempt))
    for nid, _t, _task, _q, _e, deps, *_rest in node_rows:
        for dep in deps:
            label = ", ".join(switch_cases[dep].get(nid, [])) if dep in switch_cases else ""
            edge_rows.append((dep, nid, label))
    nodes = pl.DataFrame(node_rows, orient="row", schema={
        "node_id": pl.String, "type": pl.String, "task": pl.String, "queue": pl.String, "signal": pl.String,
        "depends_on": pl.List(pl.String), "position": pl.Int64, "state": pl.String, "attempt": pl.Int64,
    })
    nodes = nodes.with_columns(pl.Series("depth", _depths(nodes), dtype=pl.Int64),
                               pl.Series("in_definition", [row[0] in known for row in node_rows], dtype=pl.Boolean))
    edges = pl.DataFrame(edge_rows, orient="row",
                         schema={"source": pl.String, "target": pl.String, "label": pl.String})
    return nodes, edges


def _depths(nodes: pl.DataFrame) -> list[int]:
    """Longest path from a root to each node (the graph's layer, for drawing)."""
    deps = {n: list(d) for n, d in nodes.select("node_id", "depends_on").iter_rows()}
    memo: dict[str, int] = {}

    def depth(node: str, seen: frozenset[str]) -> int:
        if node in memo:
            return memo[node]
        if node in seen or node not in deps:
            return 0
        value = max((depth(d, seen | {node}) + 1 for d in deps[node]), default=0)
        memo[node] = value
        return value

    return [depth(n, frozenset()) for n in deps]


def gantt_rows(tasks: pl.DataFrame, now: datetime | None = None) -> pl.DataFrame:
    """Bars for a Gantt chart of :func:`run_story`'s tasks: a 'queued' bar (created
    until a worker started it) and a main bar: 'ran' (started until finished),
    'failed' (a FAILED task's last attempt), 'cancelled', 'waiting' (WAIT /
    WAIT_FOR_SIGNAL nodes), 'queued' (active, never started) or 'decided' (SWITCH and
    skipped nodes). Unfinished bars end at ``now`` (pass the database clock), else at
    the task's last update."""
    end_active = pl.lit(now, dtype=UTC_TS) if now is not None else pl.col("updated_at")
    keep = ["node_id", "node_type", "state", "attempt"]
    queued = tasks.filter(pl.col("started_at").is_not_null()).select(
        *keep, pl.col("created_at").alias("start"), pl.col("started_at").alias("end"),
        pl.lit("queued").alias("phase"))
    main = tasks.select(
        *keep,
        pl.coalesce("started_at", "created_at").alias("start"),
        pl.coalesce("finished_at", end_active).alias("end"),
        pl.when(pl.col("state") == "FAILED").then(pl.lit("failed"))
        .when(pl.col("state") == "CANCELLED").then(pl.lit("cancelled"))
        .when(pl.col("started_at").is_not_null()).then(pl.lit("ran"))
        .when(pl.col("node_type").is_in(["WAIT", "WAIT_FOR_SIGNAL"])).then(pl.lit("waiting"))
        .when(pl.col("state").is_in(list(ACTIVE_STATES))).then(pl.lit("queued"))
        .otherwise(pl.lit("decided")).alias("phase"))
    return pl.concat([queued, main]).sort("start", "node_id", "phase")
