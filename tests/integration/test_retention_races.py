"""Retention against the engine's own writes: a run that commits into a month while
the drop waits for that month is kept; a month that may still receive runs (a client
run ID can be an hour old) is not judged; a retried drop reports what it dropped;
the coordinator's optional retention is the same drop; the drop takes the run tables
before their months, so a reader on its way from a run table to a month cannot deadlock
with it."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.engine.retention import drop_due_months
from composer_ops.repo import partitions, retention
from tests.integration.helpers import now_utc, uuid7_at


def _old_month(db_url: str, month: str = "2025-03-01", *, status: str = "SUCCEEDED") -> str:
    """A past month holding one run of ``status``; returns the run's ID."""
    day = datetime.fromisoformat(month).replace(day=10, tzinfo=UTC)
    run_id = uuid7_at(day)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SELECT composer_ensure_partitions_from(%s, 0)", (day.date(),))
        conn.execute("INSERT INTO workflow_definitions (id, name, version, spec_json, created_by) "
                     "VALUES ('wf', 'wf', 1, '{}', 'test') ON CONFLICT DO NOTHING")
        conn.execute("INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status) "
                     "VALUES (%s, 'wf', 1, %s)", (run_id, status))
    return run_id


def _waiting_for_a_lock(db_url: str, not_pid: int) -> bool:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock' AND pid <> %s", (not_pid,)).fetchone()
    return bool(row and row[0])


def _run_exists(db_url: str, run_id: str) -> bool:
    with psycopg.connect(db_url) as conn:
        return conn.execute("SELECT count(*) FROM workflow_runs WHERE id = %s", (run_id,)).fetchone() == (1,)


def test_a_run_that_commits_while_the_drop_waits_for_its_month_is_kept(db_url: str) -> None:
    _old_month(db_url)
    late = uuid7_at(datetime(2025, 3, 31, 23, 30, tzinfo=UTC))
    starter = psycopg.connect(db_url)           # a start in flight: inserted, not yet committed
    starter.execute("INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status) "
                    "VALUES (%s, 'wf', 1, 'RUNNING')", (late,))
    done: dict[str, Any] = {}

    def drop() -> None:
        try:
            done["result"] = drop_due_months(db_url, datetime(2025, 4, 1, tzinfo=UTC), lock_timeout_s=20)
        except Exception as exc:  # reported below
            done["error"] = exc

    thread = threading.Thread(target=drop)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not _waiting_for_a_lock(db_url, starter.info.backend_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.is_alive(), done
    finally:
        starter.commit()                         # the start commits while the drop waits
        starter.close()
        thread.join(30)
    assert "error" not in done, done
    assert _run_exists(db_url, late), "the drop dropped a run that committed while it waited"
    result = done["result"]
    assert "202503" not in result.dropped
    march = next(m for m in result.plan if m.month == "202503")
    assert (march.action, march.reason, march.active_run_ids) == ("keep", "has active runs", [late])


def test_a_month_that_ended_less_than_the_run_id_age_limit_ago_is_too_new(db_url: str) -> None:
    """The previous month is judged only once no client run ID can point into it; the
    limit is a parameter of the plan (the engine passes an hour), shown here with an
    age that covers the whole of last month."""
    _old_month(db_url)
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT now()").fetchone()
        assert row is not None
        now = row[0]
        far = retention.plan(conn, datetime(2100, 1, 1, tzinfo=UTC), min_age=timedelta(hours=1)).months
        near = retention.plan(conn, datetime(2100, 1, 1, tzinfo=UTC),
                              min_age=now - datetime(2025, 3, 15, tzinfo=UTC)).months
    assert {m.month: m.action for m in far}["202503"] == "drop"
    assert [(m.action, m.reason) for m in near if m.month == "202503"] == [("keep", "too new")]


def test_a_retried_request_reports_what_its_first_attempt_dropped(db_url: str) -> None:
    _old_month(db_url)
    first = drop_due_months(db_url, "2025-04-01", request_id="req-1")
    again = drop_due_months(db_url, "2025-04-01", request_id="req-1")     # as a retry after a lost COMMIT ack
    other = drop_due_months(db_url, "2025-04-01")
    assert first.dropped == again.dropped == ["202503"] and again.duplicate and not first.duplicate
    assert [m.action for m in again.plan if m.month == "202503"] == ["drop"]
    assert other.dropped == [] and not other.duplicate
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT month, request_id FROM retention_drops").fetchall() == [("202503", "req-1")]


def test_the_coordinator_retention_drops_due_months_and_reports_blocked_ones(db_url: str,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    _old_month(db_url, "2025-02-01")
    stuck = _old_month(db_url, "2025-03-01", status="RUNNING")
    with Engine.connect(db_url, pool_size=2) as engine:
        coordinator = engine.coordinator(retention="2025-04-01")
        stats = coordinator.run_once(["retention"])
        assert (stats.months_dropped, stats.months_blocked, stats.errors) == (["202502"], ["202503"], [])
        assert coordinator.run_once(["retention"]).months_blocked == []       # hourly, not every pass
        assert engine.coordinator().run_once(["retention"]).months_dropped == []   # no cut-off: no retention
    assert stuck in caplog.text
    with psycopg.connect(db_url) as conn:
        months = {p.month for p in partitions.list_partitions(conn)}
    assert "202502" not in months and "202503" in months


def test_the_drop_function_locks_the_run_tables_before_the_month(db_url: str) -> None:
    """``composer_drop_partitions`` (the seed's entry point) takes the run tables'
    locks before the month's, as the engine's drop and PostgreSQL's DROP and DETACH
    do. A reader that holds ``workflow_runs`` (it read this month) and then reads the
    month being dropped waits for nothing: the drop waits for the reader, holding no
    lock on the month. Taken the other way round (the month's partitions, then the
    parent at DETACH) the two wait for each other and PostgreSQL fails one of them."""
    old_run = _old_month(db_url)
    reader = psycopg.connect(db_url)
    reader.execute("SET lock_timeout = '20s'")           # a wait that never ends fails the test, never hangs it
    reader.execute("SELECT count(*) FROM workflow_runs WHERE id = %s", (uuid7_at(now_utc()),))
    done: dict[str, Any] = {}

    def drop() -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as conn:
                conn.execute("SET lock_timeout = '20s'")
                done["dropped"] = [r[0] for r in conn.execute("SELECT composer_drop_partitions(%s)",
                                                               (datetime(2025, 4, 1, tzinfo=UTC),))]
        except Exception as exc:  # reported below
            done["error"] = exc

    thread = threading.Thread(target=drop)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not _waiting_for_a_lock(db_url, reader.info.backend_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.is_alive(), done
        read: Any
        try:            # the reader goes on to the month the drop is after
            read = reader.execute("SELECT count(*) FROM workflow_runs WHERE id = %s", (old_run,)).fetchone()
            reader.commit()
        except psycopg.Error as exc:
            read = exc
            reader.rollback()
    finally:
        reader.close()
        thread.join(60)
    assert read == (1,), f"the reader could not read the month while the drop waited: {read!r}"
    assert done == {"dropped": ["202503"]}, done


def test_coordinator_once_names_the_months_its_retention_dropped(db_url: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from composer_ops.cli import main

    _old_month(db_url, "2025-02-01")
    assert main(["coordinator", "--once", "--retention", "2025-04-01", "--database-url", db_url]) == 0
    assert ", months dropped by retention 202502" in capsys.readouterr().out
