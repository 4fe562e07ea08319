"""The report charts: UTC wall-clock time axes, IEC byte axes, 'none' instead of empty axes,
FAILED in red and instant phases visible in the Gantt (no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import polars as pl

from composer_ops.ops import charts, leases

NOW = datetime(2026, 11, 30, 10, 44, 32, tzinfo=UTC)
TS = pl.Datetime("us", "UTC")


def _leases(rows: list[tuple[str, str | None, float | None]]) -> pl.DataFrame:
    df = pl.DataFrame([(f"run-{i}", f"t{i}", "charge", "payments", owner, 0, NOW,
                        None if left is None else NOW + timedelta(seconds=left), left, 10.0)
                       for i, (_, owner, left) in enumerate(rows)], orient="row",
                      schema={"run_id": pl.String, "task_id": pl.String, "node_id": pl.String, "queue": pl.String,
                              "lease_owner": pl.String, "attempt": pl.Int64, "started_at": TS,
                              "lease_expires_at": TS, "expires_in_s": pl.Float64, "running_s": pl.Float64})
    return df.with_columns((pl.col("expires_in_s").is_not_null() & (pl.col("expires_in_s") <= 0)).alias("expired"),
                           pl.lit("b").alias("bucket"))


def test_the_lease_timeline_is_in_utc_wall_clock_text_with_now_as_utc_text() -> None:
    fig = charts.lease_timeline(_leases([("a", "worker-a", -7200.0), ("b", "worker-b", 600.0)]), NOW)
    xs = sorted(x for trace in fig.data for x in trace.x)
    assert xs == ["2026-11-30 08:44:32.000", "2026-11-30 10:54:32.000"]   # not epoch numbers, no offset
    (line,) = fig.layout.shapes
    assert line.x0 == line.x1 == "2026-11-30 10:44:32"
    assert "2026-11-30 10:44:32 UTC" in fig.layout.annotations[0].text
    assert "(UTC)" in fig.layout.xaxis.title.text


def test_no_lease_to_draw_says_none_instead_of_an_empty_axis() -> None:
    swept = _leases([("a", None, None)])            # only a RUNNING task without a lease left
    assert "none" in charts.lease_timeline(swept, NOW).layout.annotations[0].text
    buckets = leases.expiry_buckets(_leases([]))
    fig = charts.expiry_buckets(buckets)
    assert "none" in fig.layout.annotations[0].text and fig.layout.yaxis.visible is False


def test_byte_axes_use_one_iec_unit_and_counts_stay_plain() -> None:
    inv = pl.DataFrame({"month": ["202605", "202605"], "table": ["workflow_runs", "task_instances"],
                        "partition": ["a", "b"], "rows": [16_358, 113_979], "total_bytes": [9_900_000, 65_800_000],
                        "heap_bytes": [1, 1], "index_bytes": [1, 1], "toast_bytes": [1, 1],
                        "rows_exact": [False, False]})
    fig = charts.partition_sizes(inv)
    assert fig.layout.yaxis.title.text == "size (MiB)"
    assert max(y for trace in fig.data for y in trace.y) < 63       # drawn in MiB, not bytes
    assert any("62.8 MiB" in row for trace in fig.data for row in map(str, trace.customdata))
    assert charts.partition_rows(inv).layout.yaxis.tickformat == ",~r"   # 113,979, never 114k


def test_the_gantt_draws_failed_attempts_red_and_instant_phases_visibly() -> None:
    t0 = datetime(2025, 3, 16, 12, tzinfo=UTC)
    bars = pl.DataFrame([
        ("notify", "TASK", "FAILED", 2, t0, t0 + timedelta(seconds=60), "failed"),
        ("route", "SWITCH", "COMPLETED", 0, t0 + timedelta(seconds=30), t0 + timedelta(seconds=30), "decided"),
    ], orient="row", schema={"node_id": pl.String, "node_type": pl.String, "state": pl.String,
                             "attempt": pl.Int64, "start": TS, "end": TS, "phase": pl.String})
    fig = charts.gantt(bars)
    by_phase = {trace.name: trace for trace in fig.data}
    assert by_phase["failed"].marker.color == charts.PHASE_COLORS["failed"] != charts.PHASE_COLORS["ran"]
    assert by_phase["decided"].x[0] > 0                               # a SWITCH decision has a visible width
    assert by_phase["failed"].base[0] == "2025-03-16 12:00:00.000"


def test_the_definition_graph_leaves_room_for_the_labels_above_its_top_row() -> None:
    from composer_ops.ops.investigation import definition_graph

    spec = {"id": "w", "nodes": [{"id": "charge-the-customer", "type": "TASK", "task": "t"},
                                 {"id": "ship", "type": "TASK", "task": "t", "depends_on": ["charge-the-customer"]},
                                 {"id": "notify", "type": "TASK", "task": "t", "depends_on": ["charge-the-customer"]}]}
    nodes, edges = definition_graph(spec)
    fig = charts.run_graph(nodes, edges)
    ys = [y for trace in fig.data for y in trace.y]
    xs = [x for trace in fig.data for x in trace.x]
    low, high = fig.layout.yaxis.range
    assert high - max(ys) >= 0.5 and min(ys) - low >= 0.5        # a label's height above the top row
    left, right = fig.layout.xaxis.range
    assert min(xs) - left >= 0.5 and right - max(xs) >= 0.5
