"""Retention: the plan (composer_retention_plan), the real drop that follows it, the
cut-off syntax, and `composer-ops partitions drop`."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl
import psycopg
import pytest

from composer_ops import ops
from composer_ops.cli import main
from composer_ops.core.cutoff import Cutoff, parse_cutoff
from composer_ops.core.runids import month_bounds
from composer_ops.engine.retention import drop_due_months
from composer_ops.errors import ComposerError, Invalid
from composer_ops.repo import partitions
from composer_ops.testing import fixtures
from tests.integration.helpers import connect_in_tz, seed_aligned

MAY_2025 = datetime(2025, 5, 1, tzinfo=UTC)


def _seed_committed(url: str) -> fixtures.SeedInfo:
    with psycopg.connect(url) as conn:
        info = seed_aligned(conn)
        conn.commit()
    return info


def _months(conn: psycopg.Connection[Any]) -> set[str]:
    return {p.month for p in partitions.list_partitions(conn)}


def test_plan_for_the_seed_drops_old_idle_months_and_says_why_it_keeps_others(conn: psycopg.Connection[Any]) -> None:
    info = fixtures.seed(conn)
    plan = ops.retention_plan(conn, MAY_2025, exact_rows=True)
    cur = info.current_month
    rows = plan.select("month", "action", "reason", "active_runs", "active_run_ids", "rows").rows()
    assert rows[:5] == [
        ("202412", "keep", "bounds do not match its name: "            # the seed's misaligned month
         + "; ".join(f"{t}_p202412 holds [2024-11-30 23:00, 2024-12-31 23:00) UTC"
                     for t in ("workflow_runs", "task_instances", "workflow_events")), 0, [], 0),
        ("202501", "drop", "past cut-off, no active runs", 0, [], 12),
        ("202502", "keep", "has active runs", 1, [info.runs["H6"]], 16),
        ("202503", "drop", "past cut-off, no active runs", 0, [], 18),
        ("202504", "keep", "has active runs", 1, [info.runs["H12"]], 9),
    ]
    assert [r[:3] for r in rows[5:]] == [(m, "keep", "too new") for m in sorted(_months(conn) - set(
        fixtures.HISTORY_MONTHS) - {"202412"})]
    assert rows[5][0] == cur
    assert plan["partitions"][1].to_list() == ["workflow_runs_p202501", "task_instances_p202501",
                                               "workflow_events_p202501", "run_history_p202501"]
    assert plan["cutoff"].unique().to_list() == [MAY_2025]
    # A month still in progress at the cut-off is too new: April ends at 2025-05-01 00:00 UTC.
    april = ops.retention_plan(conn, MAY_2025 - timedelta(microseconds=1)).filter(pl.col("month") == "202504")
    assert april.select("action", "reason").rows() == [("keep", "too new")]


def test_plan_never_drops_the_current_or_a_future_month(conn: psycopg.Connection[Any]) -> None:
    seed_aligned(conn)
    conn.execute("UPDATE workflow_runs SET status = 'SUCCEEDED' WHERE status IN ('RUNNING', 'PENDING')")
    plan = ops.retention_plan(conn, datetime(2100, 1, 1, tzinfo=UTC))
    row = conn.execute("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYYMM')").fetchone()
    assert row is not None
    current = row[0]
    assert plan.filter(pl.col("action") == "drop")["month"].to_list() == ["202412", *fixtures.HISTORY_MONTHS]
    assert plan.filter(pl.col("month") >= current)["reason"].unique().to_list() == ["too new"]


def test_the_drop_drops_exactly_the_plan_and_commits(db_url: str) -> None:
    info = _seed_committed(db_url)
    before = ops.retention_plan(db_url, "2025-05-01")
    result = drop_due_months(db_url, "2025-05-01")
    assert result.dropped == ["202412", "202501", "202503"] == \
        before.filter(pl.col("action") == "drop")["month"].to_list()
    assert result.attempts == 1
    with psycopg.connect(db_url) as conn:
        left = _months(conn)
        assert not {"202501", "202503"} & left and {"202502", "202504", info.current_month} <= left
        ids = {r[0] for r in conn.execute("SELECT id FROM workflow_runs").fetchall()}
        assert info.runs["H9"] not in ids and info.runs["H6"] in ids
    assert drop_due_months(db_url, "2025-05-01").dropped == []


def test_the_drop_waits_at_most_lock_timeout_and_retries(db_url: str) -> None:
    _seed_committed(db_url)
    holder = psycopg.connect(db_url)
    holder.execute("SELECT count(*) FROM task_instances_p202501")   # ACCESS SHARE until rollback
    released = threading.Timer(1.2, holder.rollback)
    released.start()
    started = time.monotonic()
    try:
        result = drop_due_months(db_url, "2025-02-01", lock_timeout_s=0.2, max_attempts=12)
    finally:
        released.join()
        holder.close()
    assert result.dropped == ["202412", "202501"] and result.attempts > 1
    assert time.monotonic() - started >= 1.0


def test_a_lock_held_throughout_fails_cleanly_and_drops_nothing(db_url: str, capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    _seed_committed(db_url)
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT count(*) FROM workflow_events_p202501")
        with pytest.raises(ComposerError, match="could not lock the partitions"):
            drop_due_months(db_url, "2025-02-01", lock_timeout_s=0.1, max_attempts=2)
        code = main(["partitions", "drop", "--older-than", "2025-02-01", "--yes", "--database-url", db_url,
                     "--lock-timeout", "0.1", "--attempts", "2"])
        holder.rollback()
    err = capsys.readouterr().err
    assert code == 1 and "could not lock the partitions" in err and "Traceback" not in err
    with psycopg.connect(db_url) as conn:
        assert "202501" in _months(conn)


def test_a_drop_that_gives_up_names_the_session_holding_the_lock(db_url: str) -> None:
    _seed_committed(db_url)
    with psycopg.connect(db_url, application_name="long-report") as holder:
        holder.execute("SELECT count(*) FROM workflow_events_p202501")
        pid = holder.info.backend_pid
        with pytest.raises(ComposerError) as raised:
            drop_due_months(db_url, "2025-02-01", lock_timeout_s=0.1, max_attempts=1)
        holder.rollback()
    assert f"locks held by pid {pid} (" in str(raised.value) and "long-report" in str(raised.value)


def test_a_lookup_of_the_holders_that_cannot_lock_is_given_up(db_url: str) -> None:
    # The holders are read from catalog views, which a session may lock too: the lookup
    # waits at most its own short lock wait, and the message says less, rather than the
    # failed drop waiting for ever on its lookup.
    _seed_committed(db_url)
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT count(*) FROM workflow_events_p202501")
        holder.execute("LOCK TABLE pg_catalog.pg_locks IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        with pytest.raises(ComposerError) as raised:
            drop_due_months(db_url, "2025-02-01", lock_timeout_s=0.1, max_attempts=1)
        took = time.monotonic() - started
        holder.rollback()
    assert "(a long transaction holds them)" in str(raised.value) and took < 20


def test_cli_dry_run_prints_the_plan_and_changes_nothing(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    info = _seed_committed(db_url)
    # months past the cut-off kept for active runs: exit 3, the runs named on stderr
    assert main(["partitions", "drop", "--older-than", "2025-05-01", "--database-url", db_url]) == 3
    out, err = capsys.readouterr()
    assert "dry-run" in out and "would drop 3 month(s)" in out and "add --yes" in out
    assert info.runs["H6"] in out
    assert err.count("\n") == 1 and "retention blocked: 202502 kept for 1 active run" in err
    assert info.runs["H6"] in err and info.runs["H12"] in err
    assert main(["partitions", "drop", "--older-than", "2025-05-01", "--json", "--database-url", db_url]) == 3
    plan = json.loads(capsys.readouterr().out)
    assert [(p["month"], p["action"]) for p in plan][:5] == [
        ("202412", "drop"), ("202501", "drop"), ("202502", "keep"), ("202503", "drop"), ("202504", "keep")]
    assert {p["reason"] for p in plan} == {"past cut-off, no active runs", "has active runs", "too new"}
    assert plan[2]["active_run_ids"] == [info.runs["H6"]]
    with psycopg.connect(db_url) as conn:
        assert set(fixtures.HISTORY_MONTHS) <= _months(conn)


def test_cli_yes_drops_and_reports_what_it_dropped(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _seed_committed(db_url)
    assert main(["partitions", "drop", "--older-than", "2025-05-01", "--yes", "--json",
                 "--database-url", db_url]) == 3                # dropped what it could, blocked by active runs
    done = json.loads(capsys.readouterr().out)
    assert [p["month"] for p in done if p["dropped"]] == ["202412", "202501", "202503"]
    assert all(p["dropped"] == (p["action"] == "drop") for p in done)
    assert main(["partitions", "drop", "--older-than", "2025-06-01", "--yes", "--database-url", db_url]) == 3
    out = capsys.readouterr().out
    assert "dropped 0 month(s)" in out
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE workflow_runs SET status = 'CANCELLED' WHERE status IN ('PENDING', 'RUNNING')")
        conn.commit()
    assert main(["partitions", "drop", "--older-than", "2025-06-01", "--yes", "--database-url", db_url]) == 0
    out, err = capsys.readouterr()
    assert "dropped 202504: workflow_runs_p202504, task_instances_p202504, workflow_events_p202504" in out
    assert err == ""


@pytest.mark.parametrize("when", ["banana", "5m", "2025-13-01", "", "12 fortnights", "2025-02-30"])
def test_cli_bad_cutoff_is_exit_2_with_one_line(db_url: str, capsys: pytest.CaptureFixture[str], when: str) -> None:
    assert main(["partitions", "drop", "--older-than", when, "--database-url", db_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "composer-ops:" in err and "Traceback" not in err


def test_parse_cutoff_forms() -> None:
    assert parse_cutoff("2025-01-31").instant == datetime(2025, 1, 31, tzinfo=UTC)
    assert parse_cutoff("2025-01-31T12:00:00Z").instant == datetime(2025, 1, 31, 12, tzinfo=UTC)
    assert parse_cutoff("2025-01-31T12:00:00+09:00").instant == datetime(2025, 1, 31, 3, tzinfo=UTC)
    assert parse_cutoff("2025-01-31 12:00").instant == datetime(2025, 1, 31, 12, tzinfo=UTC)
    assert (parse_cutoff("90d").amount, parse_cutoff("90d").unit) == (90, "days")
    assert (parse_cutoff(" 6 months ").amount, parse_cutoff(" 6 months ").unit) == (6, "months")
    assert [parse_cutoff(w).unit for w in ("1y", "2w", "36h", "3mo", "10min", "5 minutes")] == [
        "years", "weeks", "hours", "months", "minutes", "minutes"]
    for bad in ["", "  ", "90", "d90", "-5d", "5m", "30s", "next tuesday"]:     # 5m: minutes or months?
        with pytest.raises(Invalid):
            parse_cutoff(bad)


def _minus_months_utc(now: datetime, months: int) -> datetime:
    """UTC wall-clock month subtraction, clamping the day like PostgreSQL does."""
    index = now.year * 12 + now.month - 1 - months
    year, month = divmod(index, 12)
    month += 1
    days = [31, 29 if year % 4 == 0 and (year % 100 or year % 400 == 0) else 28, 31, 30, 31, 30, 31, 31, 30, 31,
            30, 31][month - 1]
    return now.replace(year=year, month=month, day=min(now.day, days))


@pytest.mark.parametrize("tz", ["UTC", "America/New_York", "Asia/Tokyo", "Pacific/Chatham"])
def test_relative_cutoffs_use_the_database_clock_in_utc(db_url: str, tz: str) -> None:
    with connect_in_tz(db_url, tz) as conn:
        now = conn.execute("SELECT now()").fetchone()[0].astimezone(UTC)
        assert ops.resolve_cutoff(conn, Cutoff(text="6 months", amount=6, unit="months")) == _minus_months_utc(now, 6)
        assert ops.resolve_cutoff(conn, parse_cutoff("90d")) == now - timedelta(days=90)
        assert ops.resolve_cutoff(conn, "36h") == now - timedelta(hours=36)


def test_plan_equals_drop_under_asia_tokyo(db_url: str) -> None:
    _seed_committed(db_url)
    with connect_in_tz(db_url, "Asia/Tokyo") as conn:
        result = drop_due_months(conn, datetime(2025, 4, 1, tzinfo=UTC))
        conn.commit()
        assert result.dropped == ["202412", "202501", "202503"]
        assert ops.plan_frame(result).filter(pl.col("action") == "drop")["month"].to_list() == result.dropped


def test_a_month_whose_finished_runs_have_live_children_is_kept_and_says_so(conn: psycopg.Connection[Any]) -> None:
    """A SUB_WORKFLOW child lives in the month of its own run ID; while it is active, the
    month of its (finished) parent is kept, naming the parent."""
    info = fixtures.seed(conn)
    parent = conn.execute("SELECT min(id) FROM workflow_runs_p202501").fetchone()
    child = conn.execute("SELECT min(id) FROM workflow_runs WHERE status = 'RUNNING' AND id >= %s",
                         (month_bounds(info.current_month)[0],)).fetchone()
    assert parent is not None and child is not None and child[0] is not None
    conn.execute("UPDATE workflow_runs SET parent_run_id = %s, parent_node_id = 'call' WHERE id = %s",
                 (parent[0], child[0]))
    plan = ops.retention_plan(conn, MAY_2025)
    row = plan.filter(pl.col("month") == "202501").select("action", "reason", "active_runs", "active_run_ids").rows()
    assert row == [("keep", "has live children", 1, [parent[0]])]
    conn.execute("UPDATE workflow_runs SET status = 'SUCCEEDED' WHERE id = %s", (child[0],))
    again = ops.retention_plan(conn, MAY_2025).filter(pl.col("month") == "202501")
    assert again.select("action").rows() == [("drop",)]


def test_a_month_whose_partition_holds_another_months_range_is_refused(
        db_url: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Retention judges a month by its partitions' names; a partition named for an old
    month that holds a future range (made by hand) would be dropped with its new rows.
    Drop, drop --archive, archive and detach refuse the month instead, dry run too,
    naming the partition and its real bounds, by the check the partition reports make."""
    run = fixtures.uuid7_text(datetime(2031, 4, 2, tzinfo=UTC), 1)
    with psycopg.connect(db_url) as conn:
        conn.execute("""CREATE TABLE workflow_runs_p202301 PARTITION OF workflow_runs FOR VALUES
                        FROM (composer_uuid7_bound('2031-04-01Z')) TO (composer_uuid7_bound('2031-05-01Z'))""")
        conn.execute("""INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, input_json)
                        VALUES (%s, 'wf', 1, 'SUCCEEDED', '{}')""", (run,))
        conn.commit()
        bad = ops.partition_inventory(conn).filter(~pl.col("bounds_match"))["partition"].to_list()
    assert bad == ["workflow_runs_p202301"]                 # what the reports flag, the plan refuses
    why = "bounds do not match its name: workflow_runs_p202301 holds [2031-04-01 00:00, 2031-05-01 00:00) UTC"
    base = ["--older-than", "2023-02-01", "--database-url", db_url]
    commands = {
        "drop": ["partitions", "drop", *base],
        "drop --yes": ["partitions", "drop", *base, "--yes"],
        "drop --archive": ["partitions", "drop", *base, "--archive", str(tmp_path / "a")],
        "drop --archive --yes": ["partitions", "drop", *base, "--archive", str(tmp_path / "a"), "--yes"],
        "archive --dry-run": ["partitions", "archive", *base, "--to", str(tmp_path / "a"), "--dry-run"],
        "archive": ["partitions", "archive", *base, "--to", str(tmp_path / "a")],
        "detach": ["partitions", "detach", *base],
        "detach --yes": ["partitions", "detach", *base, "--yes"],
    }
    for name, argv in commands.items():
        assert main(argv) == 1, name
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("composer-ops: month 202301 not ") and err[0].endswith(why), \
            (name, err)
        assert "202301" in captured.out, name
    assert not (tmp_path / "a" / "202301").exists()
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM workflow_runs WHERE id = %s", (run,)).fetchone() == (1,)
        assert "202301" in _months(conn)
        assert conn.execute("SELECT count(*) FROM operator_audit").fetchone() == (0,)
