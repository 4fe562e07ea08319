"""Partition inventory: every monthly partition of the four run-scoped tables,
its declared bounds decoded and checked against its name, its rows and bytes, how
many months ahead exist, and growth per month with a projection.

Everything here reads the catalogs only (pg_inherits, pg_class, the size functions),
except ``exact=True``, which counts each partition's rows: a full scan of every
partition, meant for small databases or an explicit request.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import polars as pl

from composer_ops.core.runids import month_start
from composer_ops.errors import Invalid
from composer_ops.ops._common import (
    RUN_TABLES,
    UTC_TS,
    Source,
    add_months,
    connection,
    db_now,
    month_label,
    rows_frame,
)
from composer_ops.repo import partitions as repo_partitions

_HEX = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

_CATALOG_SCHEMA = {
    "table": pl.String, "partition": pl.String, "month": pl.String,
    "lower_bound": pl.String, "upper_bound": pl.String, "rows": pl.Int64,
    "heap_bytes": pl.Int64, "index_bytes": pl.Int64, "toast_bytes": pl.Int64, "total_bytes": pl.Int64,
    "bounds_match": pl.Boolean,
}


def decode_uuid7_bound(text: str) -> datetime:
    """The instant encoded in the first 48 bits (milliseconds since the epoch) of a
    UUIDv7 text, e.g. a partition bound made by ``composer_uuid7_bound``."""
    if not _HEX.match(text):
        raise Invalid(f"partition bound {text!r} is not a lowercase UUID text")
    ms = int(text.replace("-", "")[:12], 16)
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def partition_inventory(source: Source = None, *, exact: bool = False) -> pl.DataFrame:
    """One row per partition: table, partition, month (YYYYMM), the declared bounds
    and the instants they decode to, whether those match the month in the name,
    rows (``rows_exact`` says whether counted or estimated from the catalog) and
    heap / index / toast / total bytes."""
    with connection(source) as conn:
        inv = rows_frame(repo_partitions.catalog(conn), _CATALOG_SCHEMA)
        counts: list[int | None] = []
        if exact:
            counts = [repo_partitions.count_rows(conn, name) for name in inv["partition"].to_list()]
    lower = [_decode_or_none(b) for b in inv["lower_bound"].to_list()]
    upper = [_decode_or_none(b) for b in inv["upper_bound"].to_list()]
    expected_lo = [month_start(m) if m else None for m in inv["month"].to_list()]
    expected_hi = [month_start(add_months(m, 1)) if m else None for m in inv["month"].to_list()]
    inv = inv.with_columns(
        pl.Series("lower_at", lower, dtype=UTC_TS),
        pl.Series("upper_at", upper, dtype=UTC_TS),
        pl.Series("month_start", expected_lo, dtype=UTC_TS),
        pl.Series("month_end", expected_hi, dtype=UTC_TS),
    ).with_columns(
        # bounds_match is the database's check (repo.partitions.catalog), the one the
        # retention plan refuses a month by.
        pl.col("bounds_match").fill_null(False),
        pl.lit(exact).alias("rows_exact"),
    )
    if exact:
        inv = inv.with_columns(pl.Series("rows", counts, dtype=pl.Int64))
    return inv.select(
        "table", "partition", "month", "month_start", "month_end", "lower_bound", "upper_bound",
        "lower_at", "upper_at", "bounds_match", "rows", "rows_exact",
        "heap_bytes", "index_bytes", "toast_bytes", "total_bytes",
    )


def _decode_or_none(text: str) -> datetime | None:
    try:
        return decode_uuid7_bound(text)
    except Invalid:
        return None


def lookahead(source: Source = None, *, minimum: int = 2) -> pl.DataFrame:
    """Per table: the current UTC month (database clock), how many consecutive months
    after it already have partitions, the first month missing, and ``alert`` when
    fewer than ``minimum`` months ahead exist (new runs would fail once the gap is
    reached; `composer-ops partitions ensure` or the coordinator's upkeep fixes it)."""
    if minimum < 0:
        raise Invalid(f"minimum months ahead must be 0 or more, got {minimum}")
    with connection(source) as conn:
        now = db_now(conn)
        inv = rows_frame(repo_partitions.catalog(conn), _CATALOG_SCHEMA)
    current = month_label(now)
    rows = []
    for table in RUN_TABLES:
        months = set(inv.filter(pl.col("table") == table)["month"].to_list())
        ahead = 0
        while add_months(current, ahead + 1) in months:
            ahead += 1
        has_current = current in months
        first_missing = current if not has_current else add_months(current, ahead + 1)
        rows.append((table, current, has_current, ahead, first_missing, minimum,
                     (not has_current) or ahead < minimum))
    return pl.DataFrame(rows, orient="row", schema={
        "table": pl.String, "current_month": pl.String, "has_current": pl.Boolean,
        "months_ahead": pl.Int64, "first_missing": pl.String, "minimum": pl.Int64, "alert": pl.Boolean,
    })


def growth(source: Source = None, *, exact: bool = False, window: int = 6, horizon: int = 6,
           inventory: pl.DataFrame | None = None) -> pl.DataFrame:
    """Rows and bytes per month (all four run-scoped tables together) for every month up to the
    current one, then ``horizon`` projected months. The projection follows the trend
    of the last ``window`` complete months that hold rows (the current month is still
    filling up): a least-squares fit of log(rows) and log(bytes) against the month, so
    steady growth of a few percent a month continues instead of flattening. With fewer
    than two such months it repeats their mean. ``total_rows`` / ``total_bytes`` are
    running totals; ``kind`` is 'actual' or 'projected'."""
    if window < 2 or horizon < 0:
        raise Invalid(f"growth needs window >= 2 and horizon >= 0, got window={window}, horizon={horizon}")
    with connection(source) as conn:
        now = db_now(conn)
        inv = inventory if inventory is not None else partition_inventory(conn, exact=exact)
    current = month_label(now)
    per_month = (inv.filter((pl.col("month") != "") & (pl.col("month") <= current))
                 .group_by("month").agg(pl.col("rows").sum(), pl.col("total_bytes").sum().alias("bytes"))
                 .sort("month"))
    past = per_month.filter((pl.col("month") < current) & (pl.col("rows") > 0)).tail(window)
    months = [_month_index(m) for m in past["month"].to_list()]
    ahead = [add_months(current, i) for i in range(1, horizon + 1)]
    rows_at = _trend(months, past["rows"].to_list())
    bytes_at = _trend(months, past["bytes"].to_list())
    records = [(m, "actual", r, b) for m, r, b in per_month.iter_rows()]
    records += [(m, "projected", rows_at(_month_index(m)), bytes_at(_month_index(m))) for m in ahead]
    out = pl.DataFrame(records, orient="row", schema={
        "month": pl.String, "kind": pl.String, "rows": pl.Int64, "bytes": pl.Int64})
    return out.with_columns(pl.col("rows").cum_sum().alias("total_rows"),
                            pl.col("bytes").cum_sum().alias("total_bytes"))


def monthly_growth_rate(months: Sequence[str], values: Sequence[float]) -> float | None:
    """The fitted growth per month (0.08 = +8 %) of ``values`` over ``months`` (YYYYMM),
    or None with fewer than two positive values."""
    points = [(_month_index(m), float(v)) for m, v in zip(months, values, strict=True) if v > 0]
    if len(points) < 2:
        return None
    slope, _ = _fit([x for x, _ in points], [math.log(v) for _, v in points])
    return math.exp(slope) - 1


def _month_index(month: str) -> int:
    return int(month[:4]) * 12 + int(month[4:]) - 1


def _fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def _trend(xs: Sequence[int], values: Sequence[float]) -> Callable[[int], int]:
    """The fitted exponential trend of ``values`` as a function of the month index."""
    points = [(x, float(v)) for x, v in zip(xs, values, strict=True) if v > 0]
    if len(points) < 2:
        mean = sum(v for _, v in points) / len(points) if points else 0.0
        return lambda _x: int(round(mean))
    slope, intercept = _fit([x for x, _ in points], [math.log(v) for _, v in points])
    return lambda x: int(round(math.exp(intercept + slope * x)))


_NODES_SCHEMA = {
    "partition": pl.String, "node": pl.String, "rows": pl.Int64, "heap_bytes": pl.Int64,
    "index_bytes": pl.Int64, "toast_bytes": pl.Int64, "total_bytes": pl.Int64,
}


def partition_nodes(source: Source = None) -> pl.DataFrame:
    """Where each partition's data is: one row per partition and node holding it
    (``local`` on a single server; ``host:port`` per worker node on Citus, whose
    partitions are split into shards), with its rows (estimate) and bytes there, and
    the month of the partition."""
    with connection(source) as conn:
        nodes = rows_frame(repo_partitions.node_stats(conn), _NODES_SCHEMA)
    return nodes.with_columns(
        pl.col("partition").str.extract(r"_p(\d{6})$", 1).fill_null("").alias("month")
    ).select("partition", "month", "node", "rows", "heap_bytes", "index_bytes", "toast_bytes", "total_bytes")


def node_totals(nodes: pl.DataFrame) -> pl.DataFrame:
    """Rows and bytes per node, with each node's share of all bytes (the spread of the data)."""
    per = (nodes.group_by("node").agg(pl.col("rows").sum(), pl.col("total_bytes").sum(),
                                      pl.col("partition").n_unique().alias("partitions"))
           .sort("node"))
    total = int(per["total_bytes"].sum()) if per.height else 0
    return per.with_columns((pl.col("total_bytes") / total if total else pl.lit(0.0)).alias("share"))


def partition_totals(inventory: pl.DataFrame) -> pl.DataFrame:
    """Rows and bytes per month and table (the partition-size chart's data)."""
    return (inventory.group_by("month", "table")
            .agg(pl.col("rows").sum(), pl.col("total_bytes").sum(), pl.col("heap_bytes").sum(),
                 pl.col("index_bytes").sum(), pl.col("toast_bytes").sum())
            .sort("month", "table"))
