"""Plotly figures for the ops DataFrames, so the notebooks only call, show and explain.

Figures are built with ``plotly.graph_objects`` from polars columns directly (no
pandas, no ``plotly.express``: together they cost a report's kernel about half a
second before the first figure). :func:`setup` makes ``fig.show()`` emit only
plotly's JSON mimetype: JupyterLab and VS Code draw it, the executed notebook stays
small, and :func:`composer_ops.reports.render_html` turns it into a self-contained
page with plotly.js embedded once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from composer_ops.lazyimport import defer_rfc3987_syntax

defer_rfc3987_syntax()  # plotly's mimetype renderer imports nbformat, hence jsonschema: -1 s per kernel

import plotly.graph_objects as go  # noqa: E402
import plotly.io as pio  # noqa: E402
import polars as pl  # noqa: E402

STATE_COLORS = {
    "PENDING": "#f2a93b", "QUEUED": "#e3c04b", "RUNNING": "#3b82c4", "WAITING": "#8e6cc4",
    "COMPLETED": "#3ea66b", "FAILED": "#d64545", "SKIPPED": "#9aa5b1", "CANCELLED": "#6b7280",
    "NOT REACHED": "#e5e7eb",
}
ACTION_COLORS = {"drop": "#d64545", "keep": "#3ea66b"}
LEASE_COLORS = {"expired": "#d64545", "not expired": "#3b82c4"}
PHASE_COLORS = {"queued": "#f2a93b", "ran": "#3b82c4", "waiting": "#8e6cc4", "decided": "#9aa5b1"}


def setup() -> None:
    """``fig.show()`` emits plotly's JSON mimetype only, on a white template."""
    pio.templates.default = "plotly_white"
    pio.renderers.default = "plotly_mimetype"


def _empty(title: str, message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font={"size": 16})
    fig.update_layout(title=title, xaxis={"visible": False}, yaxis={"visible": False}, height=260)
    return fig


def _groups(df: pl.DataFrame, by: str, order: Mapping[Any, str] | None) -> list[tuple[Any, pl.DataFrame]]:
    """``df`` split by the values of ``by``: in ``order``'s key order first (the legend
    then lists states the same way in every chart), then in order of appearance."""
    found = {key: part for (key,), part in df.group_by([by], maintain_order=True)}
    known = [k for k in (order or {}) if k in found]
    return [(k, found[k]) for k in known + [k for k in found if k not in known]]


def _hover(extra: Sequence[str], *, x: str | None = None, y: str | None = None) -> str:
    """A tooltip: the x and y values under the names given, then the ``extra`` columns
    (passed as ``customdata`` in that order), then the trace's name."""
    axes = [f"{name}=%{{{axis}}}" for axis, name in (("x", x), ("y", y)) if name is not None]
    lines = axes + [f"{name}=%{{customdata[{i}]}}" for i, name in enumerate(extra)]
    return "<br>".join(lines) + "<extra>%{fullData.name}</extra>"


def _lease_label(expired: pl.Expr) -> pl.Expr:
    """``lease``: "expired" or "not expired", the legend of both lease charts."""
    return pl.when(expired).then(pl.lit("expired")).otherwise(pl.lit("not expired")).alias("lease")


def _bars(df: pl.DataFrame, *, x: str, y: str, color: str, title: str, colors: Mapping[Any, str] | None = None,
          hover: Sequence[str] = (), barmode: str = "stack", horizontal: bool = False,
          labels: Mapping[str, str] | None = None, category_order: Sequence[str] | None = None) -> go.Figure:
    """One bar trace per value of ``color`` (what ``px.bar`` draws), with ``hover``
    columns in the tooltip."""
    names = dict(labels or {})
    fig = go.Figure()
    for key, part in _groups(df, color, colors):
        fig.add_bar(x=part[x].to_list(), y=part[y].to_list(), name=str(key),
                    orientation="h" if horizontal else "v",
                    marker_color=(colors or {}).get(key),
                    customdata=part.select(hover).rows() if hover else None,
                    hovertemplate=_hover(hover, x=names.get(x, x), y=names.get(y, y)))
    fig.update_layout(title=title, barmode=barmode, legend_title_text=color,
                      xaxis_title=names.get(x, x), yaxis_title=names.get(y, y))
    category_axis = fig.update_yaxes if horizontal else fig.update_xaxes
    if category_order is not None:
        category_axis(type="category", categoryorder="array", categoryarray=list(category_order))
    else:
        category_axis(type="category")
    return fig


def partition_sizes(inventory: pl.DataFrame) -> go.Figure:
    """Bytes per month, stacked by table; hover shows rows and the heap/index/toast split."""
    if inventory.is_empty():
        return _empty("Partition sizes", "no partitions")
    return _bars(inventory, x="month", y="total_bytes", color="table",
                 hover=["partition", "rows", "heap_bytes", "index_bytes", "toast_bytes"],
                 title="Partition size per month (heap + indexes + toast)",
                 labels={"total_bytes": "bytes", "month": "partition month (UTC)"})


def partition_rows(inventory: pl.DataFrame) -> go.Figure:
    """Rows per month and table (estimates unless counted exactly)."""
    if inventory.is_empty():
        return _empty("Rows per partition", "no partitions")
    exact = bool(inventory["rows_exact"].any())
    return _bars(inventory, x="month", y="rows", color="table", barmode="group",
                 title=f"Rows per partition ({'exact counts' if exact else 'catalog estimates'})",
                 labels={"month": "partition month (UTC)"})


def growth(frame: pl.DataFrame) -> go.Figure:
    """Rows added per month (actual, then projected) and the running total of bytes."""
    if frame.is_empty():
        return _empty("Growth", "no data")
    fig = go.Figure()
    for kind, color in (("actual", "#3b82c4"), ("projected", "#b8c7dc")):
        part = frame.filter(pl.col("kind") == kind)
        fig.add_bar(x=part["month"].to_list(), y=part["rows"].to_list(), name=f"rows ({kind})", marker_color=color)
    fig.add_scatter(x=frame["month"].to_list(), y=frame["total_bytes"].to_list(), name="total bytes", yaxis="y2",
                    mode="lines+markers")
    fig.update_layout(title="Growth per month and projection", xaxis={"type": "category"},
                      yaxis={"title": "rows added"},
                      yaxis2={"title": "total bytes", "overlaying": "y", "side": "right"})
    return fig


def active_groups(by_group: pl.DataFrame) -> go.Figure:
    """Active tasks per queue and node type, stacked by state."""
    if by_group.is_empty():
        return _empty("Active tasks", "no active tasks")
    df = by_group.with_columns((pl.col("queue") + " / " + pl.col("node_type")).alias("queue / node type"))
    return _bars(df, x="queue / node type", y="tasks", color="state", colors=STATE_COLORS,
                 hover=["oldest_age_s", "oldest_run_id", "oldest_node_id"], title="Active tasks by queue and node type")


def age_histogram(hist: pl.DataFrame) -> go.Figure:
    """Active tasks per age bucket, stacked by state."""
    order = hist.sort("bucket_order")["bucket"].unique(maintain_order=True).to_list()
    return _bars(hist, x="bucket", y="tasks", color="state", colors=STATE_COLORS, category_order=order,
                 title="Age of active tasks (since created)", labels={"bucket": "age"})


def top_runs(runs: pl.DataFrame) -> go.Figure:
    """Runs with the most active tasks."""
    if runs.is_empty():
        return _empty("Runs with the most active tasks", "no active tasks")
    return _bars(runs, x="active_tasks", y="run_id", color="workflow_id", horizontal=True,
                 hover=["status", "oldest_age_s"], title="Runs with the most active tasks")


def outbox(backlog: pl.DataFrame) -> go.Figure:
    """Outbox rows per queue: ready to claim versus delayed by retry backoff."""
    if backlog.is_empty():
        return _empty("Outbox backlog", "the outbox is empty: every dispatch has been claimed")
    long = backlog.select("queue", "ready", "delayed").unpivot(index="queue", variable_name="kind", value_name="rows")
    return _bars(long, x="queue", y="rows", color="kind", colors={"ready": "#f2a93b", "delayed": "#b8c7dc"},
                 title="Outbox backlog per queue")


def lease_timeline(leases: pl.DataFrame, now: datetime) -> go.Figure:
    """Each RUNNING task at its lease expiry, one row per owner; left of the line = expired."""
    if leases.is_empty():
        return _empty("Lease expiries", "no RUNNING tasks")
    hover = ["run_id", "node_id", "attempt", "expires_in_s"]
    df = leases.with_columns(_lease_label(pl.col("expired")))
    fig = go.Figure()
    for label, part in _groups(df, "lease", LEASE_COLORS):
        fig.add_scatter(x=part["lease_expires_at"].to_list(), y=part["lease_owner"].to_list(), mode="markers",
                        name=label, marker={"size": 12, "color": LEASE_COLORS[label]},
                        customdata=part.select(hover).rows(),
                        hovertemplate=_hover(hover, x="lease_expires_at", y="lease_owner"))
    fig.update_layout(title="Lease expiry per RUNNING task (red: expired but still RUNNING)",
                      xaxis_title="lease_expires_at", yaxis_title="lease_owner", yaxis_type="category")
    fig.add_vline(x=now.timestamp() * 1000, line_dash="dash", annotation_text="now (database clock)")
    return fig


def expiry_buckets(buckets: pl.DataFrame) -> go.Figure:
    """RUNNING tasks per time-to-expiry bucket."""
    df = buckets.with_columns(_lease_label(pl.col("bucket").str.starts_with("expired")))
    return _bars(df, x="bucket", y="tasks", color="lease", colors=LEASE_COLORS,
                 category_order=buckets["bucket"].to_list(), title="Time to lease expiry")


def attempts(dist: pl.DataFrame) -> go.Figure:
    """Active tasks per attempt number, stacked by state."""
    if dist.is_empty():
        return _empty("Attempts", "no active tasks")
    df = dist.with_columns(pl.col("attempt").cast(pl.String))
    return _bars(df, x="attempt", y="tasks", color="state", colors=STATE_COLORS,
                 title="Active tasks per attempt (0 = first try)")


def retention(plan: pl.DataFrame) -> go.Figure:
    """Bytes per partition month, coloured by the plan's action; hover shows the reason."""
    if plan.is_empty():
        return _empty("Retention plan", "no partitions")
    df = plan.with_columns(pl.col("active_run_ids").list.join(", ").alias("blocking runs"))
    return _bars(df, x="month", y="bytes", color="action", colors=ACTION_COLORS,
                 hover=["reason", "rows", "active_runs", "blocking runs"],
                 title="Retention plan: bytes per month, dropped or kept")


def run_graph(nodes: pl.DataFrame, edges: pl.DataFrame) -> go.Figure:
    """The definition's DAG, left to right by depth, nodes coloured by their state in this run."""
    if nodes.is_empty():
        return _empty("Definition graph", "the definition has no nodes")
    pos: dict[str, tuple[float, float]] = {}
    rows_per_depth: dict[int, int] = {}
    for node_id, depth in nodes.sort("depth", "position").select("node_id", "depth").iter_rows():
        slot = rows_per_depth.get(depth, 0)
        rows_per_depth[depth] = slot + 1
        pos[node_id] = (float(depth), -float(slot))
    fig = go.Figure()
    for src, dst, label in edges.iter_rows():
        if src not in pos or dst not in pos:
            continue
        (x0, y0), (x1, y1) = pos[src], pos[dst]
        fig.add_annotation(x=x1, y=y1, ax=x0, ay=y0, xref="x", yref="y", axref="x", ayref="y",
                           showarrow=True, arrowhead=2, arrowwidth=1.5, arrowcolor="#6b7280", standoff=14,
                           text="", hovertext=label or None)
        if label:
            fig.add_annotation(x=(x0 + x1) / 2, y=(y0 + y1) / 2, text=label, showarrow=False,
                               font={"size": 10, "color": "#6b7280"})
    for state, group in nodes.group_by("state", maintain_order=True):
        ids = group["node_id"].to_list()
        fig.add_scatter(x=[pos[i][0] for i in ids], y=[pos[i][1] for i in ids], mode="markers+text",
                        text=ids, textposition="top center", name=str(state[0]),
                        marker={"size": 22, "color": STATE_COLORS.get(str(state[0]), "#999"),
                                "line": {"width": 1, "color": "#333"}},
                        customdata=group.select("type", "attempt").rows(),
                        hovertemplate="%{text}<br>type %{customdata[0]}<br>attempt %{customdata[1]}<extra></extra>")
    fig.update_layout(title="Definition graph (colour: state in this run)", xaxis={"visible": False},
                      yaxis={"visible": False}, height=320 + 40 * max(rows_per_depth.values()))
    return fig


def gantt(rows: pl.DataFrame) -> go.Figure:
    """Task timeline: queued, ran, waiting and decided phases per node (horizontal bars
    from ``start`` to ``end`` on a time axis, what ``px.timeline`` draws)."""
    if rows.is_empty():
        return _empty("Task timeline", "the run has no tasks")
    df = rows.with_columns(pl.col("end").fill_null(pl.col("start")))
    df = df.with_columns(((pl.col("end") - pl.col("start")).dt.total_microseconds() / 1000).alias("ms"))
    hover = ["state", "attempt", "node_type", "start", "end"]
    fig = go.Figure()
    for phase, part in _groups(df, "phase", PHASE_COLORS):
        fig.add_bar(base=part["start"].to_list(), x=part["ms"].to_list(), y=part["node_id"].to_list(),
                    orientation="h", name=str(phase), marker_color=PHASE_COLORS.get(phase),
                    customdata=part.select(hover).rows(), hovertemplate=_hover(hover, y="node_id"))
    fig.update_layout(title="Task timeline (UTC)", barmode="overlay", xaxis={"type": "date"},
                      yaxis={"type": "category", "autorange": "reversed"}, legend_title_text="phase")
    return fig
