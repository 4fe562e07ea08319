"""Plotly figures for the ops DataFrames, so the notebooks only call, show and explain.

Time axes carry UTC wall-clock text, so every browser shows the same instant, and say
"(UTC)"; byte axes use one IEC unit named in the title; counts are plain numbers.
Figures are built with ``plotly.graph_objects`` from polars columns (no pandas, no
``plotly.express``: half a second of a kernel's start). :func:`setup` makes
``fig.show()`` emit plotly's JSON mimetype only, which
:func:`composer_ops.reports.render_html` embeds in a self-contained page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from composer_ops.lazyimport import defer_rfc3987_syntax

defer_rfc3987_syntax()  # plotly's mimetype renderer imports nbformat, hence jsonschema: -1 s per kernel

import plotly.graph_objects as go  # noqa: E402
import plotly.io as pio  # noqa: E402
import polars as pl  # noqa: E402

from composer_ops.ops.display import plain  # noqa: E402

STATE_COLORS = {
    "PENDING": "#f2a93b", "QUEUED": "#e3c04b", "RUNNING": "#3b82c4", "WAITING": "#8e6cc4",
    "COMPLETED": "#3ea66b", "FAILED": "#d64545", "SKIPPED": "#9aa5b1", "CANCELLED": "#6b7280",
    "NOT REACHED": "#e5e7eb",
}
ACTION_COLORS = {"drop": "#d64545", "keep": "#3ea66b"}
LEASE_COLORS = {"expired": "#d64545", "not expired": "#3b82c4"}
PHASE_COLORS = {"queued": "#f2a93b", "ran": "#3b82c4", "failed": "#d64545", "waiting": "#8e6cc4",
                "decided": "#9aa5b1", "cancelled": "#6b7280", "unknown node": "#111827"}
_UTC_FORMAT = "%Y-%m-%d %H:%M:%S%.3f"
_IEC = (("B", 1), ("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3), ("TiB", 1024**4))


def utc_axis(values: pl.Series) -> list[str | None]:
    """Instants as UTC wall-clock text for a plotly date axis (the same in every browser)."""
    return values.dt.convert_time_zone("UTC").dt.strftime(_UTC_FORMAT).to_list()


def byte_unit(largest: float) -> tuple[str, int]:
    """The IEC unit (name, size) a byte axis whose largest value is ``largest`` is drawn in."""
    name, size = _IEC[0]
    for unit, factor in _IEC:
        if largest >= factor:
            name, size = unit, factor
    return name, size


def _largest(values: pl.Series) -> float:
    top = values.max()
    return float(top) if isinstance(top, int | float) else 0.0


def _custom(df: pl.DataFrame, columns: Sequence[str]) -> list[list[str]]:
    """Tooltip values of ``columns`` as text in the tables' units."""
    return [[plain(c, v) for c, v in zip(columns, row, strict=True)] for row in df.select(columns).rows()]


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
                    customdata=_custom(part, hover) if hover else None,
                    hovertemplate=_hover(hover, x=names.get(x, x), y=names.get(y, y)))
    fig.update_layout(title=title, barmode=barmode, legend_title_text=color,
                      xaxis_title=names.get(x, x), yaxis_title=names.get(y, y))
    category_axis = fig.update_yaxes if horizontal else fig.update_xaxes
    value_axis = fig.update_xaxes if horizontal else fig.update_yaxes
    value_axis(tickformat=",~r", rangemode="tozero")
    values = [v for v in df[x if horizontal else y].to_list() if v is not None]
    if values and all(isinstance(v, int) for v in values) and max(values) <= 10:
        value_axis(dtick=1)   # a handful of tasks: whole-number ticks, not 0.2 steps
    if category_order is not None:
        category_axis(type="category", categoryorder="array", categoryarray=list(category_order))
    else:
        category_axis(type="category")
    return fig


def partition_sizes(inventory: pl.DataFrame) -> go.Figure:
    """Size per month, stacked by table, in one IEC unit; hover shows rows and the heap/index/toast split."""
    if inventory.is_empty():
        return _empty("Partition sizes", "none: no partitions")
    unit, size = byte_unit(_largest(inventory.group_by("month").agg(pl.col("total_bytes").sum())["total_bytes"]))
    df = inventory.with_columns((pl.col("total_bytes") / size).alias("size"))
    return _bars(df, x="month", y="size", color="table",
                 hover=["partition", "rows", "total_bytes", "heap_bytes", "index_bytes", "toast_bytes"],
                 title="Partition size per month (heap + indexes + toast)",
                 labels={"size": f"size ({unit})", "month": "partition month (UTC)"})


def partition_rows(inventory: pl.DataFrame) -> go.Figure:
    """Rows per month and table (estimates unless counted exactly)."""
    if inventory.is_empty():
        return _empty("Rows per partition", "none: no partitions")
    exact = bool(inventory["rows_exact"].any())
    return _bars(inventory, x="month", y="rows", color="table", barmode="group",
                 title=f"Rows per partition ({'exact counts' if exact else 'catalog estimates'})",
                 labels={"month": "partition month (UTC)"})


def growth(frame: pl.DataFrame) -> go.Figure:
    """Rows added per month (actual, then projected by the fitted trend) and the running
    total size, in one IEC unit."""
    if frame.is_empty():
        return _empty("Growth", "none: no partitions")
    unit, size = byte_unit(_largest(frame["total_bytes"]))
    fig = go.Figure()
    for kind, color in (("actual", "#3b82c4"), ("projected", "#b8c7dc")):
        part = frame.filter(pl.col("kind") == kind)
        fig.add_bar(x=part["month"].to_list(), y=part["rows"].to_list(), name=f"rows added ({kind})",
                    marker_color=color, customdata=_custom(part, ["rows"]),
                    hovertemplate="%{x}: %{customdata[0]} rows<extra>%{fullData.name}</extra>")
    fig.add_scatter(x=frame["month"].to_list(), y=(frame["total_bytes"] / size).to_list(), name="total size",
                    yaxis="y2", mode="lines+markers", customdata=_custom(frame, ["total_bytes"]),
                    hovertemplate="%{x}: %{customdata[0]}<extra>total size</extra>")
    fig.update_layout(title="Growth per month and projection", xaxis={"type": "category",
                                                                      "title": "month (UTC)"},
                      yaxis={"title": "rows added", "tickformat": ",~r", "rangemode": "tozero"},
                      yaxis2={"title": f"total size ({unit})", "overlaying": "y", "side": "right",
                              "rangemode": "tozero"})
    return fig


def active_groups(by_group: pl.DataFrame) -> go.Figure:
    """Active tasks per queue and node type, stacked by state."""
    if by_group.is_empty():
        return _empty("Active tasks", "none: no active tasks")
    df = by_group.with_columns((pl.col("queue") + " / " + pl.col("node_type")).alias("queue / node type"))
    return _bars(df, x="queue / node type", y="tasks", color="state", colors=STATE_COLORS,
                 hover=["oldest_age_s", "oldest_run_id", "oldest_node_id"], title="Active tasks by queue and node type")


def item_states(states: pl.DataFrame) -> go.Figure:
    """A run's MAP nodes, each one bar of its items stacked by state (the nodes are drawn
    collapsed: one bar, not one per item)."""
    if states.is_empty():
        return _empty("MAP items", "none: this run has no MAP node with items")
    return _bars(states, x="node_id", y="items", color="state", colors=STATE_COLORS, title="MAP items by state",
                 labels={"node_id": "MAP node"})


def age_histogram(hist: pl.DataFrame) -> go.Figure:
    """Active tasks per age bucket, stacked by state."""
    order = hist.sort("bucket_order")["bucket"].unique(maintain_order=True).to_list()
    return _bars(hist, x="bucket", y="tasks", color="state", colors=STATE_COLORS, category_order=order,
                 title="Age of active tasks (since created)", labels={"bucket": "age"})


def top_runs(runs: pl.DataFrame) -> go.Figure:
    """Runs with the most active tasks."""
    if runs.is_empty():
        return _empty("Runs with the most active tasks", "none: no active tasks")
    return _bars(runs, x="active_tasks", y="run_id", color="workflow_id", horizontal=True,
                 hover=["status", "oldest_age_s"], title="Runs with the most active tasks")


def outbox(backlog: pl.DataFrame) -> go.Figure:
    """Outbox rows per queue: ready to claim versus delayed by retry backoff."""
    if backlog.is_empty():
        return _empty("Outbox backlog", "none: every dispatch has been claimed")
    long = backlog.select("queue", "ready", "delayed").unpivot(index="queue", variable_name="kind", value_name="rows")
    return _bars(long, x="queue", y="rows", color="kind", colors={"ready": "#f2a93b", "delayed": "#b8c7dc"},
                 title="Outbox backlog per queue")


def lease_timeline(leases: pl.DataFrame, now: datetime) -> go.Figure:
    """Each RUNNING task at its lease expiry (UTC), one row per owner; left of the line = expired.
    Tasks without a lease, or with one at 'infinity' (odd data), are not on this axis (the
    anomalies table lists them)."""
    df = leases.filter(pl.col("lease_expires_at").is_not_null() & pl.col("expires_in_s").is_finite())
    if df.is_empty():
        return _empty("Lease expiries", "none: no RUNNING task holds a lease")
    hover = ["run_id", "node_id", "attempt", "expires_in_s"]
    df = df.with_columns(_lease_label(pl.col("expired")), pl.col("lease_owner").fill_null("(none)"))
    fig = go.Figure()
    for label, part in _groups(df, "lease", LEASE_COLORS):
        fig.add_scatter(x=utc_axis(part["lease_expires_at"]), y=part["lease_owner"].to_list(), mode="markers",
                        name=label, marker={"size": 12, "color": LEASE_COLORS[label]},
                        customdata=_custom(part, hover),
                        hovertemplate=_hover(hover, x="lease expires at (UTC)", y="lease_owner"))
    now_text = now.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    fig.update_layout(title="Lease expiry per RUNNING task (red: expired but still RUNNING)",
                      xaxis={"title": "lease expires at (UTC)", "type": "date"}, yaxis_title="lease_owner",
                      yaxis_type="category")
    fig.add_shape(type="line", x0=now_text, x1=now_text, y0=0, y1=1, yref="paper", line={"dash": "dash"})
    fig.add_annotation(x=now_text, y=1, yref="paper", yanchor="bottom", showarrow=False,
                       text=f"now (database clock): {now_text} UTC")
    return fig


def expiry_buckets(buckets: pl.DataFrame) -> go.Figure:
    """RUNNING tasks per time-to-expiry bucket; "none" when no task holds a lease."""
    if int(buckets["tasks"].sum()) == 0:
        return _empty("Time to lease expiry", "none: no RUNNING task holds a lease")
    df = buckets.with_columns(_lease_label(pl.col("bucket").str.starts_with("expired")))
    return _bars(df, x="bucket", y="tasks", color="lease", colors=LEASE_COLORS,
                 category_order=buckets["bucket"].to_list(), title="Time to lease expiry")


def attempts(dist: pl.DataFrame) -> go.Figure:
    """Active tasks per attempt number, stacked by state."""
    if dist.is_empty():
        return _empty("Attempts", "none: no active tasks")
    df = dist.with_columns(pl.col("attempt").cast(pl.String))
    return _bars(df, x="attempt", y="tasks", color="state", colors=STATE_COLORS,
                 title="Active tasks per attempt (0 = first try)")


def retention(plan: pl.DataFrame) -> go.Figure:
    """Size per partition month (one IEC unit), coloured by the plan's action; hover shows the reason."""
    if plan.is_empty():
        return _empty("Retention plan", "none: no partitions")
    unit, size = byte_unit(_largest(plan["bytes"]))
    df = plan.with_columns(pl.col("active_run_ids").list.join(", ").alias("blocking runs"),
                           (pl.col("bytes") / size).alias("size"))
    return _bars(df, x="month", y="size", color="action", colors=ACTION_COLORS,
                 hover=["reason", "rows", "bytes", "active_runs", "blocking runs"],
                 title="Retention plan: size per month, dropped or kept",
                 labels={"size": f"size ({unit})", "month": "partition month (UTC)"})


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
    odd = nodes.filter(~pl.col("in_definition")) if "in_definition" in nodes.columns else nodes.clear()
    for state, group in nodes.join(odd.select("node_id"), on="node_id", how="anti").group_by(
            "state", maintain_order=True):
        ids = group["node_id"].to_list()
        fig.add_scatter(x=[pos[i][0] for i in ids], y=[pos[i][1] for i in ids], mode="markers+text",
                        text=ids, textposition="top center", name=str(state[0]),
                        marker={"size": 22, "color": STATE_COLORS.get(str(state[0]), "#999"),
                                "line": {"width": 1, "color": "#333"}},
                        customdata=group.select("type", "attempt").rows(),
                        hovertemplate="%{text}<br>type %{customdata[0]}<br>attempt %{customdata[1]}<extra></extra>")
    if odd.height:
        ids = odd["node_id"].to_list()
        fig.add_scatter(x=[pos[i][0] for i in ids], y=[pos[i][1] for i in ids], mode="markers+text",
                        text=[f"{i} (not in definition)" for i in ids], textposition="bottom right",
                        name="ANOMALY: not in definition",
                        marker={"size": 22, "symbol": "x", "color": PHASE_COLORS["unknown node"]},
                        customdata=odd.select("state", "attempt").rows(),
                        hovertemplate="%{text}<br>state %{customdata[0]}<br>attempt %{customdata[1]}<extra></extra>")
    # Fixed ranges with room around the outer nodes: autorange fits the markers only, so the
    # labels above the top row (and long ones at either end) would be cut off.
    depths, rows = max(rows_per_depth), max(rows_per_depth.values())
    fig.update_layout(title="Definition graph (colour: state in this run)",
                      xaxis={"visible": False, "range": [-0.6, depths + 0.6]},
                      yaxis={"visible": False, "range": [-(rows - 1) - 0.6, 0.7]}, height=320 + 40 * rows)
    return fig


def gantt(rows: pl.DataFrame) -> go.Figure:
    """Task timeline (UTC): queued, ran (red when the task FAILED), waiting and decided
    phases per node, as horizontal bars from ``start`` to ``end``. Instant phases (a
    SWITCH decision, a skip) get a minimum width so they stay visible."""
    if rows.is_empty():
        return _empty("Task timeline", "none: the run has no tasks")
    df = rows.with_columns(pl.col("end").fill_null(pl.col("start")))
    first: datetime = df["start"].min()  # type: ignore[assignment]
    last: datetime = df["end"].max()  # type: ignore[assignment]
    span_ms = max((last - first).total_seconds() * 1000, 1.0)
    least = span_ms / 150
    df = df.with_columns(((pl.col("end") - pl.col("start")).dt.total_microseconds() / 1000).alias("ms"))
    df = df.with_columns(pl.max_horizontal(pl.col("ms"), pl.lit(least)).alias("drawn_ms"),
                         pl.col("ms").map_elements(lambda v: plain("x_s", v / 1000), return_dtype=pl.String)
                         .alias("lasted"))
    hover = ["state", "attempt", "node_type", "start", "end", "lasted"]
    fig = go.Figure()
    for phase, part in _groups(df, "phase", PHASE_COLORS):
        fig.add_bar(base=utc_axis(part["start"]), x=part["drawn_ms"].to_list(), y=part["node_id"].to_list(),
                    orientation="h", name=str(phase), marker_color=PHASE_COLORS.get(phase),
                    customdata=_custom(part, hover), hovertemplate=_hover(hover, y="node_id"))
    fig.update_layout(title="Task timeline (UTC)", barmode="overlay", xaxis={"type": "date", "title": "time (UTC)"},
                      yaxis={"type": "category", "autorange": "reversed"}, legend_title_text="phase")
    return fig
