"""composer_ops.ops partition inventory, look-ahead and growth on the seeded database."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import polars as pl
import psycopg
import pytest

from composer_ops import ops
from composer_ops.core.runids import add_months
from composer_ops.errors import Invalid
from composer_ops.repo.partitions import RUN_TABLES
from composer_ops.testing import fixtures
from tests.integration.helpers import connect_in_tz


@pytest.fixture
def seeded(conn: psycopg.Connection[Any]) -> fixtures.SeedInfo:
    return fixtures.seed(conn)


def _rows(inv: pl.DataFrame, by: str) -> dict[str, int]:
    return {k: int(v) for k, v in inv.group_by(by).agg(pl.col("rows").sum()).iter_rows()}


@pytest.mark.parametrize("exact", [True, False])
def test_inventory_lists_every_partition_with_exact_rows(conn: psycopg.Connection[Any],
                                                         seeded: fixtures.SeedInfo, exact: bool) -> None:
    # The seed ran ANALYZE, so the catalog estimates equal the exact counts here.
    inv = ops.partition_inventory(conn, exact=exact)
    want = fixtures.expected_figures(seeded)["partition_sizes"]
    assert inv.height == 35                 # 9 months of three tables, and run_history in all but 202412
    assert sorted(inv["month"].unique().to_list()) == want["months"]
    assert _rows(inv, "table") == {"workflow_runs": 25, "task_instances": 79, "workflow_events": 3, "run_history": 1}
    assert _rows(inv, "month") == want["rows_by_month"]
    assert inv["rows_exact"].to_list() == [exact] * 35
    march = {t: r for t, r in inv.filter(pl.col("month") == "202503").select("table", "rows").iter_rows()}
    assert march == {"workflow_runs": 3, "task_instances": 13, "workflow_events": 2, "run_history": 0}
    # The seed's December 2024 was made an hour early (odd data the reports flag).
    assert sorted(inv.filter(~pl.col("bounds_match"))["partition"].to_list()) == [
        "task_instances_p202412", "workflow_events_p202412", "workflow_runs_p202412"]
    assert [a.kind for a in ops.anomalies.partitions(inv)] == ["partition bounds do not match its name"] * 3
    assert (inv["heap_bytes"] + inv["index_bytes"] + inv["toast_bytes"] == inv["total_bytes"]).all()
    assert (inv["total_bytes"] > 0).all()


def test_decoded_bounds_are_the_month_edges(conn: psycopg.Connection[Any], seeded: fixtures.SeedInfo) -> None:
    row = ops.partition_inventory(conn).filter(pl.col("partition") == "task_instances_p202503").row(0, named=True)
    assert row["lower_at"] == datetime(2025, 3, 1, tzinfo=UTC)
    assert row["upper_at"] == datetime(2025, 4, 1, tzinfo=UTC)
    bound = conn.execute("SELECT composer_uuid7_bound('2025-03-01Z')").fetchone()
    assert bound is not None
    assert row["lower_bound"] == bound[0]


def test_decode_uuid7_bound() -> None:
    assert ops.decode_uuid7_bound("01941f29-7c00-0000-0000-000000000000") == datetime(2025, 1, 1, tzinfo=UTC)
    assert ops.decode_uuid7_bound(fixtures.uuid7_text(datetime(2026, 2, 3, 4, 5, 6, 789000, tzinfo=UTC), 9)) == \
        datetime(2026, 2, 3, 4, 5, 6, 789000, tzinfo=UTC)
    for bad in ["", "MINVALUE", "01941F29-7C00-0000-0000-000000000000", "01941f29-7c00"]:
        with pytest.raises(Invalid):
            ops.decode_uuid7_bound(bad)


def test_a_partition_whose_bounds_do_not_match_its_name_is_flagged(conn: psycopg.Connection[Any]) -> None:
    # What the seed's arithmetic did under America/New_York: the month starts at 05:00 UTC, not midnight.
    conn.execute("""CREATE TABLE workflow_runs_p203001 PARTITION OF workflow_runs FOR VALUES
                    FROM (composer_uuid7_bound('2030-01-01 05:00Z')) TO (composer_uuid7_bound('2030-02-01Z'))""")
    inv = ops.partition_inventory(conn)
    bad = inv.filter(~pl.col("bounds_match"))
    assert bad["partition"].to_list() == ["workflow_runs_p203001"]
    assert bad["lower_at"][0] == datetime(2030, 1, 1, 5, tzinfo=UTC)
    assert bad["month_start"][0] == datetime(2030, 1, 1, tzinfo=UTC)


def test_lookahead_counts_months_after_the_current_one_and_alerts(conn: psycopg.Connection[Any],
                                                                  seeded: fixtures.SeedInfo) -> None:
    cur = seeded.current_month
    ahead = ops.lookahead(conn, minimum=2)
    assert ahead["months_ahead"].to_list() == [3, 3, 3, 3]
    assert ahead["current_month"].to_list() == [cur] * 4
    assert ahead["first_missing"].to_list() == [add_months(cur, 4)] * 4
    assert not ahead["alert"].any()
    assert ops.lookahead(conn, minimum=4)["alert"].all()
    conn.execute(f"DROP TABLE workflow_events_p{add_months(cur, 2)}".encode())
    gap = {t: (n, m, a) for t, n, m, a in ops.lookahead(conn, minimum=2)
           .select("table", "months_ahead", "first_missing", "alert").iter_rows()}
    assert gap["workflow_events"] == (1, add_months(cur, 2), True)
    assert gap["workflow_runs"] == (3, add_months(cur, 4), False)
    with pytest.raises(Invalid):
        ops.lookahead(conn, minimum=-1)


def test_growth_per_month_and_projection(conn: psycopg.Connection[Any], seeded: fixtures.SeedInfo) -> None:
    g = ops.growth(conn, horizon=3)
    cur = seeded.current_month
    assert g.filter(pl.col("kind") == "actual").select("month", "rows").rows() == [
        ("202412", 0), ("202501", 12), ("202502", 16), ("202503", 18), ("202504", 9), (cur, 53)]
    projected = g.filter(pl.col("kind") == "projected")
    assert projected["month"].to_list() == [add_months(cur, i) for i in (1, 2, 3)]
    # The trend of 12, 16, 18, 9 over four consecutive months (log-linear fit): -7.2 % a month.
    assert ops.monthly_growth_rate(["202501", "202502", "202503", "202504"], [12, 16, 18, 9]) == \
        pytest.approx(-0.0718, abs=1e-4)
    assert g["total_bytes"].to_list() == g["bytes"].cum_sum().to_list()
    assert ops.growth(conn, horizon=0).height == 6
    with pytest.raises(Invalid):
        ops.growth(conn, window=1)


def test_the_projection_follows_steady_growth(conn: psycopg.Connection[Any], seeded: fixtures.SeedInfo) -> None:
    # Six complete months growing 8 % a month, then the current month half full: the
    # projection continues the 8 % (a mean of the last months would stay flat at ~1,300).
    cur = seeded.current_month
    months = [add_months(cur, i) for i in range(-6, 1)]
    rows = [round(1000 * 1.08**i) for i in range(6)] + [700]
    inventory = pl.DataFrame({"month": months, "rows": rows, "total_bytes": [r * 100 for r in rows]})
    g = ops.growth(conn, horizon=2, inventory=inventory)
    # (the inputs are rounded to whole rows, so the fit is within a row of the exact 8 %)
    assert g.filter(pl.col("kind") == "projected")["rows"].to_list() == pytest.approx(
        [1000 * 1.08**7, 1000 * 1.08**8], abs=1.5)
    assert ops.monthly_growth_rate(months[:-1], rows[:-1]) == pytest.approx(0.08, abs=1e-4)
    assert ops.monthly_growth_rate(months[:1], rows[:1]) is None


def test_the_same_figures_under_another_session_time_zone(db_url: str) -> None:
    with connect_in_tz(db_url, "Asia/Tokyo") as tokyo:
        info = fixtures.seed(tokyo)
        inv = ops.partition_inventory(tokyo, exact=True)
        assert inv.filter(pl.col("month") != "202412")["bounds_match"].all()
        assert _rows(inv, "month") == fixtures.expected_figures(info)["partition_sizes"]["rows_by_month"]
        # The current month is the UTC one, not Tokyo's (which differs for 9 hours a month).
        utc_month = tokyo.execute("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYYMM')").fetchone()[0]
        assert ops.lookahead(tokyo)["current_month"].to_list() == [utc_month] * len(RUN_TABLES)
