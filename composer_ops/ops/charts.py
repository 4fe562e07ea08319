"""Plotly figures for the ops DataFrames, so the notebooks only call, show and explain.

:func:`setup` makes figures render self-contained: plotly.js is embedded once in
the notebook (the ``notebook`` renderer, not the CDN one), so an HTML export of an
executed notebook works offline.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import plotly.express as px
import plotly.graph_objects as go
import plotly.io as pio
import polars as pl

STATE_COLORS = {
    "PENDING": "#f2a93b", "QUEUED": "#e3c04b", "RUNNING": "#3b82c4", "WAITING": "#8e6cc4",
    "COMPLETED": "#3ea66b", "FAILED": "#d64545", "SKIPPED": "#9aa5b1", "CANCELLED": "#6b7280",
    "NOT REACHED": "#e5e7eb",
}
ACTION_COLORS = {"drop": "#d64545", "keep": "#3ea66b"}


def setup() -> None:
    """Render figures with plotly.js embedded in the notebook (self-contained HTML reports)."""
    pio.templates.default = "plotly_white"
    pio.renderers.default = "plotly_mimetype+notebook"


def _empty(title: str, message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font={"size": 16})
    fig.update_layout(title=title, xaxis={"visible": False}, yaxis={"visible": False}, height=260)
    return fig


def partition_sizes(inventory: pl.DataFrame) -> go.Figure:
    """Bytes per month, stacked by table; hover shows rows and the heap/index/toast split."""
    if inventory.is_empty():
        return _empty("Partition sizes", "no partitions")
    fig = px.bar(inventory.to_pandas(), x="month", y="total_bytes", color="table", barmode="stack",
                 hover_data=["partition", "rows", "heap_bytes", "index_bytes", "toast_bytes"],
                 title="Partition size per month (heap + indexes + toast)",
                 labels={"total_bytes": "bytes", "month": "partition month (UTC)"})
    fig.update_xaxes(type="category")
    return fig


def partition_rows(inventory: pl.DataFrame) -> go.Figure:
    """Rows per month and table (estimates unless counted exactly)."""
    if inventory.is_empty():
        return _empty("Rows per partition", "no partitions")
    exact = bool(inventory["rows_exact"].any())
    fig = px.bar(inventory.to_pandas(), x="month", y="rows", color="table", barmode="group",
                 title=f"Rows per partition ({'exact counts' if exact else 'catalog estimates'})",
                 labels={"month": "partition month (UTC)"})
    fig.update_xaxes(type="category")
    return fig


def growth(frame: pl.DataFrame) -> go.Figure:
    """Rows added per month (actual, then projected) and the running total of bytes."""
    if frame.is_empty():
        return _empty("Growth", "no data")
    pdf = frame.to_pandas()
    fig = go.Figure()
    for kind, color in (("actual", "#3b82c4"), ("projected", "#b8c7dc")):
        part = pdf[pdf["kind"] == kind]
        fig.add_bar(x=part["month"], y=part["rows"], name=f"rows ({kind})", marker_color=color)
    fig.add_scatter(x=pdf["month"], y=pdf["total_bytes"], name="total bytes", yaxis="y2", mode="lines+markers")
    fig.update_layout(title="Growth per month and projection", xaxis={"type": "category"},
                      yaxis={"title": "rows added"},
                      yaxis2={"title": "total bytes", "overlaying": "y", "side": "right"})
    return fig


def active_groups(by_group: pl.DataFrame) -> go.Figure:
    """Active tasks per queue and node type, stacked by state."""
    if by_group.is_empty():
        return _empty("Active tasks", "no active tasks")
    df = by_group.with_columns((pl.col("queue") + " / " + pl.col("node_type")).alias("queue / node type"))
    return px.bar(df.to_pandas(), x="queue / node type", y="tasks", color="state", color_discrete_map=STATE_COLORS,
                  hover_data=["oldest_age_s", "oldest_run_id", "oldest_node_id"],
                  title="Active tasks by queue and node type")


def age_histogram(hist: pl.DataFrame) -> go.Figure:
    """Active tasks per age bucket, stacked by state."""
    order = hist.sort("bucket_order")["bucket"].unique(maintain_order=True).to_list()
    return px.bar(hist.to_pandas(), x="bucket", y="tasks", color="state", color_discrete_map=STATE_COLORS,
                  category_orders={"bucket": order}, title="Age of active tasks (since created)",
                  labels={"bucket": "age"})


def top_runs(runs: pl.DataFrame) -> go.Figure:
    """Runs with the most active tasks."""
    if runs.is_empty():
        return _empty("Runs with the most active tasks", "no active tasks")
    return px.bar(runs.to_pandas(), x="active_tasks", y="run_id", orientation="h", color="workflow_id",
                  hover_data=["status", "oldest_age_s"], title="Runs with the most active tasks")


def outbox(backlog: pl.DataFrame) -> go.Figure:
    """Outbox rows per queue: ready to claim versus delayed by retry backoff."""
    if backlog.is_empty():
        return _empty("Outbox backlog", "the outbox is empty: every dispatch has been claimed")
    long = backlog.select("queue", "ready", "delayed").unpivot(index="queue", variable_name="kind", value_name="rows")
    return px.bar(long.to_pandas(), x="queue", y="rows", color="kind", barmode="stack",
                  color_discrete_map={"ready": "#f2a93b", "delayed": "#b8c7dc"}, title="Outbox backlog per queue")


def lease_timeline(leases: pl.DataFrame, now: datetime) -> go.Figure:
    """Each RUNNING task at its lease expiry, one row per owner; left of the line = expired."""
    if leases.is_empty():
        return _empty("Lease expiries", "no RUNNING tasks")
    fig = px.scatter(leases.to_pandas(), x="lease_expires_at", y="lease_owner", color="expired",
                     color_discrete_map={True: "#d64545", False: "#3b82c4"},
                     hover_data=["run_id", "node_id", "attempt", "expires_in_s"],
                     title="Lease expiry per RUNNING task (red: expired but still RUNNING)")
    fig.add_vline(x=now.timestamp() * 1000, line_dash="dash", annotation_text="now (database clock)")
    fig.update_traces(marker={"size": 12})
    return fig


def expiry_buckets(buckets: pl.DataFrame) -> go.Figure:
    """RUNNING tasks per time-to-expiry bucket."""
    df = buckets.with_columns(pl.col("bucket").str.starts_with("expired").alias("expired"))
    return px.bar(df.to_pandas(), x="bucket", y="tasks", color="expired",
                  color_discrete_map={True: "#d64545", False: "#3b82c4"},
                  category_orders={"bucket": buckets["bucket"].to_list()}, title="Time to lease expiry")


def attempts(dist: pl.DataFrame) -> go.Figure:
    """Active tasks per attempt number, stacked by state."""
    if dist.is_empty():
        return _empty("Attempts", "no active tasks")
    df = dist.with_columns(pl.col("attempt").cast(pl.String))
    return px.bar(df.to_pandas(), x="attempt", y="tasks", color="state", color_discrete_map=STATE_COLORS,
                  title="Active tasks per attempt (0 = first try)")


def retention(plan: pl.DataFrame) -> go.Figure:
    """Bytes per partition month, coloured by the plan's action; hover shows the reason."""
    if plan.is_empty():
        return _empty("Retention plan", "no partitions")
    df = plan.with_columns(pl.col("active_run_ids").list.join(", ").alias("blocking runs"))
    fig = px.bar(df.to_pandas(), x="month", y="bytes", color="action", color_discrete_map=ACTION_COLORS,
                 hover_data=["reason", "rows", "active_runs", "blocking runs"],
                 title="Retention plan: bytes per month, dropped or kept")
    fig.update_xaxes(type="category")
    return fig


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
    """Task timeline: queued, ran, waiting and decided phases per node."""
    if rows.is_empty():
        return _empty("Task timeline", "the run has no tasks")
    df = rows.with_columns(pl.col("end").fill_null(pl.col("start")))
    fig = px.timeline(df.to_pandas(), x_start="start", x_end="end", y="node_id", color="phase",
                      hover_data=["state", "attempt", "node_type"], title="Task timeline (UTC)",
                      color_discrete_map={"queued": "#f2a93b", "ran": "#3b82c4", "waiting": "#8e6cc4",
                                          "decided": "#9aa5b1"})
    fig.update_yaxes(autorange="reversed")
    return fig


def table(df: pl.DataFrame, max_rows: int = 50) -> Any:
    """A pandas view of ``df`` for display (notebooks render it as an HTML table)."""
    return df.head(max_rows).to_pandas()
