"""The reports' units, tables and self-checks (no database)."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone

import polars as pl

from composer_ops.ops.charts import byte_unit, utc_axis
from composer_ops.ops.display import SelfChecks, count, duration, iec_bytes, run_id_html, table, utc_text

RUN = "0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e8f"


def test_bytes_are_iec() -> None:
    assert [iec_bytes(n) for n in (0, 1023, 1024, 76_650_906, 5 * 2**30)] == [
        "0 B", "1023 B", "1.0 KiB", "73.1 MiB", "5.0 GiB"]
    assert byte_unit(76_650_906) == ("MiB", 2**20) and byte_unit(10) == ("B", 1)


def test_durations_are_humanised_to_two_units() -> None:
    assert [duration(s) for s in (0.3, 4.23, 42, 65, 3600, 3725, 187_205, -300)] == [
        "300 ms", "4.2 s", "42 s", "1 min 5 s", "1 h", "1 h 2 min", "2 d 4 h", "-5 min"]
    assert duration(None) == "" and count(1_234_567) == "1,234,567"


def test_instants_are_utc_whatever_their_zone() -> None:
    tokyo = datetime(2025, 3, 16, 21, 0, 35, tzinfo=timezone(timedelta(hours=9)))
    assert utc_text(tokyo) == "2025-03-16 12:00:35"
    series = pl.Series([tokyo], dtype=pl.Datetime("us", "Asia/Tokyo"))
    assert utc_axis(series) == ["2025-03-16 12:00:35.000"]


def test_tables_show_units_full_ids_and_none_when_empty() -> None:
    df = pl.DataFrame({"run_id": [RUN], "age_s": [3725.0], "total_bytes": [2**21],
                       "created_at": [datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)], "error": ["x" * 200]})
    page = table(df).html
    for shown in (RUN, "1 h 2 min", "2.0 MiB", "2025-01-02 03:04:05", "x" * 200, "created_at (UTC)",
                  f"composer-ops report run_investigation -p run_id {RUN}"):
        assert shown in page, shown
    assert '"orderData"' in page   # sorted by the numbers, not the text shown
    assert table(df.clear()).html == '<p class="composer-none">none</p>'
    assert run_id_html(RUN).count(RUN) == 4   # shown, and in the title, tooltip and copied command


def test_self_checks_show_only_what_failed_with_the_figure() -> None:
    checks = SelfChecks()
    checks.check("adds up", True)
    histogram, groups = 7, 8
    checks.check("histogram equals groups", histogram == groups, lambda: f"histogram {histogram}, groups {groups}")
    checks.check("cannot even be computed", lambda: 1 / 0 == 1)
    assert checks.failed == ["histogram equals groups", "cannot even be computed"]
    page = checks.show().html
    assert "2 of 3 self-checks FAILED" in page and "histogram 7, groups 8" in page
    assert "ZeroDivisionError" in page and "adds up" not in page
    ok = SelfChecks()
    ok.check("adds up", True)
    assert "All 1 self-checks passed." in ok.show().html


def test_a_table_does_not_import_pandas() -> None:
    code = ("import sys, polars as pl\nfrom composer_ops.ops.display import table\n"
            "table(pl.DataFrame({'a': [1]}))\nprint('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
