"""`composer-ops check`'s timers-overdue figure: a WAITING task whose timer (wake_at)
passed longer ago than the threshold alerts (exit 1, the runbook named, the gauge in the
Prometheus file); under the threshold it does not; a running coordinator fires the
timer and the alert clears. Only the coordinator fires timers, so this is the check
that notices a stopped coordinator while workers keep running."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.ops.health import Check, Thresholds, check_health
from composer_ops.testing.processes import wait_for
from tests.notebooks.harness import as_role

TIMER = {"id": "tmo", "nodes": [{"id": "z", "type": "WAIT", "duration_s": 3600},
                                {"id": "b", "type": "TASK", "task": "t", "depends_on": ["z"]}]}
STARTS = {"id": "sto", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "nobody",
                                  "timeouts": {"schedule_to_start_s": 3600}}]}
SIGNAL = {"id": "sgo", "nodes": [{"id": "s", "type": "WAIT_FOR_SIGNAL", "signal": "go", "timeout_s": 3600,
                                  "on_timeout": "continue"}]}


@pytest.fixture
def engine(engine: Engine) -> Engine:
    engine.deploy(TIMER)
    engine.deploy(SIGNAL)
    engine.deploy(STARTS)
    return engine


def _overdue(db_url: str, run_id: str, seconds: float) -> None:
    """The run's WAITING task's timer passed ``seconds`` ago (a coordinator stopped since)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        cur = conn.execute("UPDATE task_instances SET wake_at = now() - make_interval(secs => %s) "
                           "WHERE run_id = %s AND state = 'WAITING'", (seconds, run_id))
        assert cur.rowcount == 1


def _timers_check(db_url: str, threshold_s: float = 60) -> Check:
    health = check_health(db_url, Thresholds(timers_overdue_s=threshold_s))
    return next(c for c in health.checks if c.name == "timers overdue")


def test_a_timer_overdue_past_the_threshold_alerts_with_exit_1_and_its_runbook(
        engine: Engine, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    waiting = engine.start("tmo")
    signalled = engine.start("sgo")
    _overdue(db_url, waiting, 3600)
    _overdue(db_url, signalled, 90)
    prom = tmp_path / "composer.prom"
    assert main(["check", "--database-url", as_role(db_url), "--prometheus", str(prom)]) == 1
    lines = capsys.readouterr().out.splitlines()
    (alert,) = [ln for ln in lines if ln.startswith("ALERT")]
    assert alert.startswith("ALERT  timers overdue:"), lines
    assert f"2 WAITING task(s) whose timer passed over 1 min ago, the oldest 1 h overdue in run {waiting} " \
           "(node z): is a coordinator running?" in alert, alert
    assert lines[lines.index(alert) + 1].strip() == "runbook: composer-ops runbook timers_overdue"
    samples = {(s.name, s.labels.get("check", "")): s.value
               for f in text_string_to_metric_families(prom.read_text(encoding="utf-8")) for s in f.samples}
    assert samples[("composer_timers_overdue_seconds", "")] == pytest.approx(3600, abs=60)
    assert samples[("composer_check_alert", "composer_timers_overdue_seconds")] == 1.0
    assert samples[("composer_check_threshold", "composer_timers_overdue_seconds")] == 60.0
    # A higher threshold (option and environment variable alike): under it, no alert.
    assert main(["check", "--database-url", db_url, "--timers-overdue", "7200"]) == 0
    out = capsys.readouterr().out
    assert "ALERT" not in out, out
    assert "2 timer(s) due, none overdue over 2 h" in out, out


def test_the_threshold_comes_from_the_environment(engine: Engine, db_url: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _overdue(db_url, engine.start("tmo"), 30)
    assert main(["check", "--json", "--database-url", db_url]) == 0
    capsys.readouterr()
    monkeypatch.setenv("COMPOSER_CHECK_TIMERS_OVERDUE", "10")
    assert main(["check", "--json", "--database-url", db_url]) == 1
    doc = json.loads(capsys.readouterr().out)
    check = next(c for c in doc["checks"] if c["metric"] == "composer_timers_overdue_seconds")
    assert check["alert"] is True and check["threshold"] == 10 and check["runbook"] == "timers_overdue"


def test_under_the_threshold_or_not_due_it_does_not_alert(engine: Engine, db_url: str) -> None:
    engine.start("tmo")                                  # due in an hour
    check = _timers_check(db_url)
    assert (check.value, check.alert) == (0.0, False)
    _overdue(db_url, engine.start("tmo"), 20)
    check = _timers_check(db_url)
    assert check.alert is False and 20 <= check.value < 60, check
    assert check.detail == "1 timer(s) due, none overdue over 1 min"


def test_a_soft_deleted_or_finished_run_s_timer_is_not_counted(engine: Engine, db_url: str) -> None:
    """As the coordinator's timer loop: only active runs that are not soft-deleted."""
    gone, done = engine.start("tmo"), engine.start("tmo")
    _overdue(db_url, gone, 600)
    _overdue(db_url, done, 600)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE workflow_runs SET deleted_at = now() WHERE id = %s", (gone,))
        conn.execute("UPDATE workflow_runs SET status = 'CANCELLED' WHERE id = %s", (done,))
    assert _timers_check(db_url).alert is False


def test_a_running_coordinator_fires_the_timers_and_the_alert_clears(engine: Engine, db_url: str) -> None:
    waiting, signalled = engine.start("tmo"), engine.start("sgo")
    _overdue(db_url, waiting, 300)
    _overdue(db_url, signalled, 200)
    assert _timers_check(db_url).alert is True
    running = engine.coordinator(interval=0.1)     # as `composer-ops coordinator` runs one
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: not _timers_check(db_url).alert, timeout=60,
                 what="the coordinator to fire the overdue timers")
    finally:
        running.stop()
        thread.join(60)
    assert not thread.is_alive()
    check = _timers_check(db_url)
    assert (check.value, check.alert) == (0.0, False), check
    states = {r: {t.node_id: t.state for t in engine.get_run(r).tasks} for r in (waiting, signalled)}
    assert states[waiting]["z"] == "COMPLETED" and states[signalled]["s"] == "COMPLETED", states


def test_a_dispatch_past_its_schedule_to_start_deadline_alerts_until_a_coordinator_fails_it(
        engine: Engine, db_url: str) -> None:
    """The timer loop also fails a task whose dispatch no worker claimed by its
    schedule_to_start deadline: one left in the outbox past the threshold alerts too."""
    run_id = engine.start("sto")
    with psycopg.connect(db_url, autocommit=True) as conn:
        cur = conn.execute("UPDATE task_outbox SET start_by = now() - interval '1 hour' WHERE run_id = %s",
                           (run_id,))
        assert cur.rowcount == 1
    check = _timers_check(db_url)
    assert check.alert is True and check.value == pytest.approx(3600, abs=60), check
    assert check.detail == (f"1 dispatch(es) past their schedule_to_start deadline by over 1 min, the oldest 1 h "
                            f"in run {run_id}: is a coordinator running?")
    assert _timers_check(db_url, threshold_s=7200).alert is False
    running = engine.coordinator(interval=0.1)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: not _timers_check(db_url).alert, timeout=60, what="the coordinator to fail the task")
    finally:
        running.stop()
        thread.join(60)
    assert engine.get_run(run_id).status == "FAILED"
