"""`composer-ops check`: exit codes on healthy and unhealthy databases, thresholds,
JSON, and the Prometheus textfile parsed back with prometheus_client's parser."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from composer_ops.cli import main
from tests.notebooks.harness import as_role, seed_committed

METRICS = ["composer_replay_lag_seconds", "composer_partitions_months_ahead", "composer_sweeper_lag_seconds",
           "composer_timers_overdue_seconds",
           "composer_outbox_oldest_ready_seconds",
           "composer_retention_blocked_months", "composer_long_waits_without_timeout",
           "composer_webhook_deliveries_failing", "composer_schedules_late", "composer_queue_paused_longest_seconds"]


def _samples(path: Path) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(path.read_text(encoding="utf-8")):
        for sample in family.samples:
            out[(sample.name, sample.labels.get("check", ""))] = sample.value
    return out


def test_a_fresh_database_is_healthy(db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prom = tmp_path / "composer.prom"
    assert main(["check", "--database-url", as_role(db_url), "--prometheus", str(prom)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "healthy" and "ALERT" not in out and len(out.splitlines()) == len(METRICS) + 1
    samples = _samples(prom)
    assert samples[("composer_check_healthy", "")] == 1.0
    assert samples[("composer_partitions_months_ahead", "")] == 3.0
    assert all(samples[("composer_check_alert", m)] == 0.0 for m in METRICS)
    assert [p.name for p in tmp_path.iterdir()] == ["composer.prom"]   # written atomically, nothing left over


def test_the_seeded_database_alerts_and_says_why(db_url: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    info = seed_committed(db_url)
    with psycopg.connect(db_url) as conn:   # a webhook endpoint that keeps failing
        conn.execute("""INSERT INTO webhook_deliveries (run_id, url, payload, attempts, next_attempt_at, last_status)
                        VALUES (%s, 'https://example.invalid/hook', '{}', 5, now() + interval '1 minute', 503)""",
                     (info.runs["H7"],))
    prom = tmp_path / "composer.prom"
    assert main(["check", "--json", "--database-url", as_role(db_url), "--prometheus", str(prom),
                 "--retention-older-than", "2025-05-01"]) == 1
    doc = json.loads(capsys.readouterr().out)
    checks = {c["metric"]: c for c in doc["checks"]}
    assert doc["healthy"] is False and list(checks) == METRICS
    alerting = {m for m, c in checks.items() if c["alert"]}
    assert alerting == set(METRICS) - {"composer_partitions_months_ahead", "composer_replay_lag_seconds",
                                       "composer_timers_overdue_seconds",  # the seed's timers are not due
                                       "composer_schedules_late",          # the seed has no schedule
                                       "composer_queue_paused_longest_seconds"}
    assert checks["composer_sweeper_lag_seconds"]["value"] == pytest.approx(7200, abs=60)   # L7's lease
    assert checks["composer_outbox_oldest_ready_seconds"]["value"] == pytest.approx(1800, abs=60)   # L6
    assert checks["composer_retention_blocked_months"]["value"] == 2
    assert info.runs["H6"] in checks["composer_retention_blocked_months"]["detail"]
    assert checks["composer_long_waits_without_timeout"]["value"] == 1
    assert checks["composer_webhook_deliveries_failing"]["value"] == 1
    samples = _samples(prom)
    assert samples[("composer_check_healthy", "")] == 0.0
    for metric, check in checks.items():
        assert samples[(metric, "")] == pytest.approx(check["value"])
        assert samples[("composer_check_alert", metric)] == (1.0 if check["alert"] else 0.0)
    # Thresholds move the verdict: with generous ones only the structural alerts stay.
    assert main(["check", "--database-url", db_url, "--retention-older-than", "2025-05-01",
                 "--sweeper-lag", "86400", "--outbox-ready-age", "86400", "--long-wait-h", "100000",
                 "--webhook-attempts", "10"]) == 1
    out = capsys.readouterr().out
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("ALERT")] == ["ALERT  retention blocked"]


def test_thresholds_come_from_the_environment(db_url: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COMPOSER_CHECK_MONTHS_AHEAD_MIN", "5")
    assert main(["check", "--database-url", db_url]) == 1
    assert "ALERT  partition months ahead: 3 (alert below 5)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--sweeper-lag", "-1"], ["--months-ahead-min", "-2"],
                                  ["--retention-older-than", "yesterday"], ["--webhook-attempts", "0"],
                                  ["--long-wait-h", "nan"], ["--outbox-ready-age", "soon"],
                                  ["--timers-overdue", "-1"]])
def test_bad_thresholds_exit_2_with_one_line(argv: list[str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    prom = tmp_path / "x.prom"
    try:
        code = main(["check", *argv, "--database-url", "postgresql://nobody@/nowhere?host=/nonexistent",
                     "--prometheus", str(prom)])
    except SystemExit as exc:   # argparse's own type errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not prom.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--sweeper-lag", "inf"], "--sweeper-lag must be a finite number of at most 3155760000 (100 years in seconds)"),
    (["--outbox-ready-age", "inf"], "--outbox-ready-age must be a finite number"),
    (["--queue-paused-h", "inf"], "--queue-paused-h must be a finite number of at most 876600 (100 years in hours)"),
    (["--long-wait-h", "inf"], "--long-wait-h must be a finite number"),
    (["--long-wait-h", "1e12"], "--long-wait-h must be a finite number"),    # an interval out of range
    (["--schedule-late=-inf"], "--schedule-late must be a number >= 0, got -inf"),
])
def test_infinite_and_huge_thresholds_exit_2_before_the_database_is_read(
        argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prom = tmp_path / "x.prom"
    code = main(["check", *argv, "--database-url", "postgresql://nobody@/nowhere?host=/nonexistent",
                 "--prometheus", str(prom)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not prom.exists()


def test_an_unreadable_database_is_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["check", "--database-url", "postgresql://nobody@/nowhere?host=/nonexistent"])
    err = capsys.readouterr().err
    assert code == 1 and "cannot connect" in err and err.count("\n") == 1


def test_check_help_shows_every_threshold_with_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for env, default in (("COMPOSER_CHECK_MONTHS_AHEAD_MIN", "2"), ("COMPOSER_CHECK_SWEEPER_LAG", "60"),
                         ("COMPOSER_CHECK_OUTBOX_READY_AGE", "300"), ("COMPOSER_RETENTION_OLDER_THAN", "6 months"),
                         ("COMPOSER_CHECK_LONG_WAIT_H", "24"), ("COMPOSER_CHECK_WEBHOOK_ATTEMPTS", "3"),
                         ("COMPOSER_CHECK_SCHEDULE_LATE", "300"), ("COMPOSER_CHECK_TIMERS_OVERDUE", "60")):
        assert f"[env: {env}] (default: {default})" in text, env
    assert "COMPOSER_CHECK_PROMETHEUS" in text


RUNBOOKS = {"composer_replay_lag_seconds": "replay_lag", "composer_partitions_months_ahead": "partitions_ahead",
            "composer_sweeper_lag_seconds": "sweeper_lag", "composer_timers_overdue_seconds": "timers_overdue",
            "composer_outbox_oldest_ready_seconds": "outbox_ready",
            "composer_retention_blocked_months": "retention_blocked",
            "composer_long_waits_without_timeout": "long_waits",
            "composer_webhook_deliveries_failing": "failing_webhooks", "composer_schedules_late": "schedule_late",
            "composer_queue_paused_longest_seconds": "downstream_overloaded"}


def test_every_check_names_its_runbook(db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from composer_ops.runbooks import catalogue

    seed_committed(db_url)
    prom = tmp_path / "composer.prom"
    assert main(["check", "--json", "--database-url", db_url, "--prometheus", str(prom)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert {c["metric"]: c["runbook"] for c in doc["checks"]} == RUNBOOKS
    assert set(RUNBOOKS.values()) <= set(catalogue.names())     # each is a runbook that exists
    labels = {}
    for family in text_string_to_metric_families(prom.read_text(encoding="utf-8")):
        for sample in family.samples:
            if sample.name == "composer_check_alert":
                labels[sample.labels["check"]] = sample.labels["runbook"]
    assert labels == RUNBOOKS
    assert main(["check", "--database-url", db_url]) == 1
    lines = capsys.readouterr().out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("ALERT"):
            name = line.split(":")[0].removeprefix("ALERT").strip()
            metric = next(c["metric"] for c in doc["checks"] if c["name"] == name)
            assert lines[i + 1].strip() == f"runbook: composer-ops runbook {RUNBOOKS[metric]}"


def test_an_unreachable_database_says_so_in_the_textfile_and_the_json(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prom = tmp_path / "composer.prom"
    assert main(["check", "--database-url", db_url, "--prometheus", str(prom)]) == 0
    assert _samples(prom)[("composer_check_healthy", "")] == 1.0
    capsys.readouterr()
    code = main(["check", "--json", "--database-url", "postgresql://nobody@/nowhere?host=/nonexistent",
                 "--prometheus", str(prom)])
    captured = capsys.readouterr()
    assert code == 1 and captured.err.count("\n") == 1 and "cannot connect" in captured.err
    doc = json.loads(captured.out)
    assert doc["healthy"] is False and doc["up"] is False and doc["checks"] == []
    assert doc["error"]["kind"] == "unavailable" and "cannot connect" in doc["error"]["message"]
    samples = _samples(prom)
    # The last good run's figures are gone: only "down" is left to alert on.
    assert samples == {("composer_check_up", ""): 0.0, ("composer_check_healthy", ""): 0.0}


def test_an_unwritable_prometheus_path_is_one_line_and_exit_2(db_url: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    code = main(["check", "--database-url", db_url, "--prometheus", str(blocker / "composer.prom")])
    captured = capsys.readouterr()
    assert code == 2 and captured.err.count("\n") == 1 and captured.out == "", captured
    assert f"--prometheus: directory {blocker}: cannot write there" in captured.err
    assert ".tmp" not in captured.err and "Traceback" not in captured.err


def test_check_help_says_it_never_starts_the_server(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "started if it is not running" not in text
    assert "which must be running (composer-ops db up)" in text


def test_a_lease_at_infinity_is_flagged_not_taken_for_bad_input(db_url: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A RUNNING task whose lease expiry was set to 'infinity' by hand: check reads it,
    writes its figures and names it as odd data (exit 1 here for the seed's own alerts)."""
    info = seed_committed(db_url)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_instances SET lease_expires_at = 'infinity' WHERE run_id = %s", (info.runs["L1"],))
    prom = tmp_path / "composer.prom"
    assert main(["check", "--json", "--database-url", as_role(db_url), "--prometheus", str(prom)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["up"] is True and doc["odd_leases"] == 2        # L1's infinite lease and L9's missing one
    sweeper = next(c for c in doc["checks"] if c["metric"] == "composer_sweeper_lag_seconds")
    assert sweeper["value"] == pytest.approx(7200, abs=60)      # L7's lease, as without the odd row
    assert "odd data: 2 RUNNING task(s) without a lease or with an infinite one" in sweeper["detail"]
    samples = _samples(prom)
    assert samples[("composer_check_up", "")] == 1.0 and samples[("composer_running_odd_leases", "")] == 2.0


def test_a_check_behind_a_held_lock_gives_up_in_its_time(db_url: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """It waited for as long as an operator's ACCESS EXCLUSIVE lock on a partition was
    held (24 s in the tryout; from cron every minute, the runs stack up). Now its reads
    give up after its lock timeout: exit 1, down in the JSON and the textfile."""
    import threading
    import time

    from composer_ops.ops import health

    monkeypatch.setattr(health, "CHECK_LOCK_TIMEOUT_S", 0.5)
    prom = tmp_path / "composer.prom"
    held, done = threading.Event(), threading.Event()

    def hold() -> None:           # the lock, for 20 s at most: without a timeout the check waits it out
        with psycopg.connect(db_url) as holder:
            holder.execute("LOCK TABLE workflow_runs IN ACCESS EXCLUSIVE MODE")
            held.set()
            done.wait(20)
            holder.rollback()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(30)
    began = time.monotonic()
    code = main(["check", "--json", "--database-url", db_url, "--prometheus", str(prom)])
    took = time.monotonic() - began
    done.set()
    thread.join(30)
    captured = capsys.readouterr()
    assert code == 1 and took < 15, (code, took)          # not the lock's whole hold
    assert json.loads(captured.out)["up"] is False, captured.out
    assert "a read waited 0.5s for a lock held elsewhere and gave up (locks held by pid " in captured.err, captured.err
    assert "COMPOSER_LOCK_WAIT" not in captured.err          # check's wait is its own, not the variable's
    assert _samples(prom)[("composer_check_up", "")] == 0.0
