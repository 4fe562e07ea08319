"""Partition routing, composer_ensure_partitions(_from) and composer_drop_partitions."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
import pytest

from composer_ops.errors import Invalid
from composer_ops.repo import clock, partitions, runs, signals, tasks
from tests.integration.helpers import add_definition, add_run, at_once, connect_in_tz, drop_months, uuid7_at

TIMEZONES = ["UTC", "America/New_York", "Asia/Tokyo"]


def _months(conn: Any, table: str = "workflow_runs") -> list[str]:
    return [p.month for p in partitions.list_partitions(conn) if p.table == table]


def _month_list(first: date, n: int) -> list[str]:
    out, y, m = [], first.year, first.month
    for _ in range(n):
        out.append(f"{y:04d}{m:02d}")
        y, m = (y + 1, 1) if m == 12 else (y, m + 1)
    return out


def test_run_tasks_and_events_land_in_the_run_ids_month(conn: Any) -> None:
    add_definition(conn)
    partitions.ensure_from(conn, date(2025, 3, 1), 1)
    run_id = add_run(conn, at=datetime(2025, 3, 31, 23, 59, 59, tzinfo=UTC))
    tasks.insert_task(conn, run_id, task_id="t1", node_id="a", node_type="TASK", queue="q", state="PENDING",
                      now=clock.now(conn))
    signals.buffer_signal(conn, run_id, signal_id="e1", name="go", payload=None, now=clock.now(conn))
    where = conn.execute("""
        SELECT (SELECT tableoid::regclass::text FROM workflow_runs WHERE id = %(r)s),
               (SELECT tableoid::regclass::text FROM task_instances WHERE run_id = %(r)s),
               (SELECT tableoid::regclass::text FROM workflow_events WHERE run_id = %(r)s)""",
                         {"r": run_id}).fetchone()
    assert where == ("workflow_runs_p202503", "task_instances_p202503", "workflow_events_p202503")


def test_run_id_outside_every_partition_is_invalid_not_a_driver_error(conn: Any) -> None:
    add_definition(conn)
    with pytest.raises(Invalid, match="no partition holds this run ID's month"):
        add_run(conn, at=datetime(2019, 1, 1, tzinfo=UTC))
    assert conn.execute("SELECT count(*) FROM workflow_runs").fetchone()[0] == 0


def test_ensure_creates_this_month_and_n_ahead_idempotently(conn: Any) -> None:
    today = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()[0]
    expected = _month_list(today, 7)
    partitions.ensure(conn, 6)
    for table in partitions.RUN_TABLES:
        assert _months(conn, table)[:7] == expected, table
    assert partitions.ensure(conn, 6) == 0


@pytest.mark.parametrize("tz", TIMEZONES)
def test_ensure_from_bounds_match_names_in_any_timezone(db_url: str, tz: str) -> None:
    with connect_in_tz(db_url, tz) as conn:
        # 2026-12 is where the seed's arithmetic skipped February under America/New_York.
        before = _preexisting(conn)
        tables = len(partitions.RUN_TABLES)
        assert partitions.ensure_from(conn, date(2026, 12, 15), 3) == tables * 4 - before
        assert _preexisting(conn) == tables * 4
        rows = {p.name: p for p in partitions.list_partitions(conn)}
        for month in ["202612", "202701", "202702", "202703"]:
            part = rows[f"workflow_runs_p{month}"]
            y, m = int(month[:4]), int(month[4:])
            start = datetime(y, m, 1, tzinfo=UTC)
            end = datetime(y + (m == 12), 1 if m == 12 else m + 1, 1, tzinfo=UTC)
            bound = conn.execute("SELECT composer_uuid7_bound(%s), composer_uuid7_bound(%s)",
                                 (start, end)).fetchone()
            assert (part.lower_bound, part.upper_bound) == bound


def _preexisting(conn: Any) -> int:
    row = conn.execute("""SELECT count(*) FROM pg_class WHERE relname ~ '_p(202612|202701|202702|202703)$'
                           AND relkind = 'r'""").fetchone()
    return int(row[0])


def test_two_sessions_ensuring_at_once_both_succeed(db_url: str) -> None:
    def ensure(go: Callable[[], None]) -> int:
        with psycopg.connect(db_url) as c:
            go()
            return partitions.ensure_from(c, date(2024, 1, 1), 11)

    assert sorted(at_once(ensure)) == [0, 12 * len(partitions.RUN_TABLES)]


def _layout(conn: Any) -> dict[str, str]:
    """Months 2025-01..2025-06; 02 holds a RUNNING run, 03 a PENDING one, others finished."""
    add_definition(conn)
    partitions.ensure_from(conn, date(2025, 1, 1), 5)
    statuses = {"202501": "SUCCEEDED", "202502": "RUNNING", "202503": "PENDING", "202504": "FAILED",
                "202505": "CANCELLED", "202506": "SUCCEEDED"}
    ids = {}
    for month, status in statuses.items():
        ts = datetime(int(month[:4]), int(month[4:]), 28, 12, tzinfo=UTC)
        run_id = add_run(conn, at=ts, status=status)
        tasks.insert_task(conn, run_id, task_id=f"t{month}", node_id="a", node_type="TASK", queue="q",
                          state="COMPLETED", now=clock.now(conn))
        signals.buffer_signal(conn, run_id, signal_id=f"e{month}", name="go", payload=None, now=clock.now(conn))
        ids[month] = run_id
    return ids


@pytest.mark.parametrize("tz", TIMEZONES)
@pytest.mark.parametrize(("cutoff", "dropped"), [
    (datetime(2025, 5, 1, tzinfo=UTC), ["202501", "202504"]),                          # April's last instant
    (datetime(2025, 5, 1, tzinfo=UTC) - timedelta(microseconds=1), ["202501"]),       # April not over yet
    (datetime(2025, 4, 30, 20, tzinfo=UTC), ["202501"]),                               # April 30 evening, UTC
    (datetime(2025, 6, 1, 9, tzinfo=UTC), ["202501", "202504", "202505"]),
    (datetime(2024, 12, 31, tzinfo=UTC), []),
])
def test_drop_only_whole_months_before_cutoff_without_active_runs(
        db_url: str, tz: str, cutoff: datetime, dropped: list[str]) -> None:
    with connect_in_tz(db_url, tz) as conn:
        _layout(conn)
        before = set(_months(conn))
        assert drop_months(conn, cutoff) == dropped
        after = set(_months(conn))
        assert before - after == set(dropped)
        for table in partitions.RUN_TABLES:          # referencing tables went with their month
            assert not set(dropped) & set(_months(conn, table)), table
        assert {"202502", "202503"} <= after          # active runs keep their month


def test_drop_judges_a_month_over_in_utc_whatever_the_session_timezone(db_url: str) -> None:
    """The seed's drop read the month in the session's zone: under Asia/Tokyo it dropped
    March 2025 at 2025-03-30 UTC, before the month was over."""
    with connect_in_tz(db_url, "Asia/Tokyo") as conn:
        conn.execute("SELECT composer_ensure_partitions_from('2025-03-01', 0)")
        conn.commit()
        assert drop_months(conn, datetime(2025, 3, 30, tzinfo=UTC)) == []
        assert drop_months(conn, datetime(2025, 4, 1, tzinfo=UTC)) == ["202503"]


def test_runs_in_dropped_months_are_gone_and_others_remain(conn: Any) -> None:
    ids = _layout(conn)
    drop_months(conn, datetime(2025, 7, 1, tzinfo=UTC))
    remaining = {r[0] for r in conn.execute("SELECT id FROM workflow_runs").fetchall()}
    assert remaining == {ids["202502"], ids["202503"]}
    assert runs.get_run(conn, ids["202502"]).status == "RUNNING"
    assert uuid7_at(datetime(2025, 1, 1, tzinfo=UTC))[:8] == "01941f29"
