"""The runbook notebooks (notebooks/runbooks/): stored clean, one per check alert and
incident; under nbval against the seeded database as the read-only role (diagnose and
plan checked through their key figures); ``composer-ops runbook`` end to end as the
reader (diagnoses, refuses to act) and as the operator role (acts, keeps the record,
whose path the audit rows name)."""

from __future__ import annotations

import json
import re
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from composer_ops.cli import main
from composer_ops.ops.health import check_health
from composer_ops.runbooks import RUNBOOKS, catalogue
from composer_ops.testing import fixtures
from tests.notebooks.harness import (
    NOTEBOOKS,
    as_role,
    code_cells,
    failed_items,
    passed_count,
    run_nbval_parallel,
    seed_committed,
)

BOOKS = sorted((NOTEBOOKS / "runbooks").glob("*.ipynb"))


@pytest.fixture
def operator(db_url: str) -> Iterator[str]:
    """A person on call as docs/security.md sets one up: a role that is a member of
    composer_ops_reader (to read every partition) and composer_ops_engine (to act)."""
    name = f"oncall_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {name} NOLOGIN IN ROLE composer_ops_reader, composer_ops_engine".encode())
    try:
        yield name
    finally:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(f"DROP ROLE {name}".encode())


def test_one_runbook_per_check_alert_and_incident_stored_clean() -> None:
    assert [p.stem for p in BOOKS] == sorted(catalogue.names())
    for path in BOOKS:
        nb = json.loads(path.read_text(encoding="utf-8"))
        tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, path.name
        source = "".join(tagged[0]["source"])
        assert "database_url = None" in source and "confirm = False" in source, path.name
        assert sum("key-figures" in c.get("metadata", {}).get("tags", []) for c in nb["cells"]) == 1, path.name
        headings = [ln for c in nb["cells"] if c["cell_type"] == "markdown" for ln in "".join(c["source"]).splitlines()
                    if ln.startswith("## ")]
        assert headings == ["## 1. Diagnose", "## 2. Plan", "## 3. Act"], path.name
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, path.name
        assert nb["metadata"]["kernelspec"]["name"] == "python3"


def test_every_check_alert_has_its_runbook(db_url: str) -> None:
    health = check_health(db_url)
    assert {c.name: c.runbook for c in health.checks} == {r.alert: r.name for r in RUNBOOKS if r.alert}


@pytest.mark.timeout(900)
def test_nbval_runs_every_runbook_green_as_the_reader_role(db_url: str, tmp_path: Path) -> None:
    info = seed_committed(db_url)
    expect = tmp_path / "expected.json"
    expect.write_text(json.dumps(fixtures.expected_figures(info)), encoding="utf-8")
    env = {"COMPOSER_DATABASE_URL": as_role(db_url), "COMPOSER_OPS_EXPECT": str(expect)}
    results = run_nbval_parallel([BOOKS[0::2], BOOKS[1::2]], env, timeout=800)
    output = "\n".join(r.stdout + r.stderr for r in results)
    assert [r.returncode for r in results] == [0, 0], output[-4000:]
    assert sum(passed_count(r.stdout) for r in results) == sum(code_cells(p) for p in BOOKS), output[-2000:]
    assert not failed_items(output)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["runbook", *argv, "--progress", "0"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _audit(db_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url) as conn:
        return conn.execute("SELECT action, target, counts, command, db_role FROM operator_audit "
                            "ORDER BY id").fetchall()


def _status(db_url: str, run_id: str) -> str:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


def _record(out: Path, name: str) -> Path:
    """The newest record of runbook ``name`` (its HTML page)."""
    page = sorted((out / "runbooks" / name).glob("*.html"))[-1]
    assert re.fullmatch(r"\d{8}T\d{6}Z\.html", page.name) and page.with_suffix(".ipynb").exists()
    return page


def test_the_reader_role_diagnoses_plans_and_is_refused_acting(db_url: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    info = seed_committed(db_url)
    out = tmp_path / "reports"
    code, printed, err = _run(["retention_blocked", "-p", "confirm", "true", "--database-url", as_role(db_url),
                               "--out", str(out)], capsys)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "acting needs the operator role (composer_ops_engine or the owner)" in err
    assert "composer_ops_reader may only read" in err and "nothing was changed" in err
    page = _record(out, "retention_blocked")
    text = page.read_text(encoding="utf-8")
    # The diagnosis and the plan are in the record, and it says plainly why nothing was done.
    assert info.runs["H6"] in text and info.runs["H12"] in text
    assert "Not acted:" in text and "acting needs the operator role" in text and "Traceback" not in text
    assert _audit(db_url) == [] and _status(db_url, info.runs["H6"]) == "RUNNING"
    index = (out / "index.html").read_text(encoding="utf-8")
    assert f'href="runbooks/retention_blocked/{page.name}"' in index and "not acted: acting needs" in index


def test_the_operator_acts_and_the_audit_rows_name_the_record(db_url: str, operator: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    info = seed_committed(db_url)
    out = tmp_path / "reports"
    role, operator = operator, as_role(db_url, operator)
    # Without confirm: a dry run, nothing changed.
    code, printed, _ = _run(["long_waits", "-p", "cancel_runs", json.dumps([info.runs["H6"]]),
                             "--database-url", operator, "--out", str(out)], capsys)
    assert code == 0 and "dry run: nothing was changed" in printed, _
    assert _audit(db_url) == [] and _status(db_url, info.runs["H6"]) == "RUNNING"
    dry = _record(out, "long_waits")
    assert info.runs["H6"] in dry.read_text(encoding="utf-8")
    code, printed, err = _run(["long_waits", "-p", "confirm", "true", "-p", "cancel_runs",
                               json.dumps([info.runs["H6"]]), "--database-url", operator, "--out", str(out)], capsys)
    assert code == 0, err
    assert "did: runs cancel: cancelled 1 run(s), skipped 0" in printed
    assert _status(db_url, info.runs["H6"]) == "CANCELLED"
    record = _record(out, "long_waits").with_suffix(".ipynb")
    assert record.stem != dry.stem
    ((action, target, counts, command, db_role),) = _audit(db_url)
    assert (action, target, counts, db_role) == ("runs cancel", f"runs {info.runs['H6']}",
                                                 {"cancelled": 1, "skipped": 0}, role)
    assert command.startswith("composer-ops runbook long_waits -p confirm true")
    assert command.endswith(f"[record {record}]")
    # The list shows the runbooks with the alert each serves, and the records kept.
    assert main(["runbook", "list", "--out", str(out), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {r["name"]: r["alert"] for r in listed["runbooks"]}["long_waits"] == "long waits without timeout"
    kept, earlier = listed["records"]       # newest first
    assert kept["runbook"] == "long_waits" and kept["did"] == ["runs cancel: cancelled 1 run(s), skipped 0"]
    assert kept["confirm"] and not earlier["confirm"] and earlier["did"] == []
    assert "did: runs cancel" in (out / "index.html").read_text(encoding="utf-8")


@pytest.mark.timeout(600)
def test_each_acting_runbook_acts_through_the_engine_with_its_audit_row(
        db_url: str, operator: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    info = seed_committed(db_url)
    out = tmp_path / "reports"
    role, operator = operator, as_role(db_url, operator)

    def act(name: str, *params: str) -> str:
        code, printed, err = _run([name, "-p", "confirm", "true", *params, "--database-url", operator,
                                   "--out", str(out)], capsys)
        assert code == 0, err
        return printed

    printed = act("retention_blocked", "-p", "cutoff", "2025-05-01")
    # H6 (February) is cancelled; so is H12 (April), whose definition version does not exist,
    # on a stand-in of its definition made from its rows (it has none).
    assert "month 202502: cancelled 1 run(s), skipped 0" in printed
    assert "month 202504: cancelled 1 run(s), skipped 0" in printed
    assert _status(db_url, info.runs["H6"]) == "CANCELLED" and _status(db_url, info.runs["H12"]) == "CANCELLED"
    printed = act("dead_worker")      # worker-b's two expired leases
    assert "lease sweep: 2 expired lease(s) handled" in printed
    with psycopg.connect(db_url) as conn:
        lapsed = conn.execute("SELECT count(*) FROM task_instances WHERE state = 'RUNNING' "
                              "AND lease_expires_at < now()").fetchone()
    assert lapsed == (0,)
    printed = act("sweeper_lag")      # the same sweep: nothing left to take back
    assert "lease sweep: 0 expired lease(s) handled" in printed
    printed = act("partitions_ahead", "-p", "months_ahead", "4")
    assert "partitions ensure: created 4 partition(s) up to 4 month(s) ahead" in printed   # one month, four tables
    printed = act("replay_failed", "-p", "since", "2025-03-01", "-p", "workflow", "nightly-report")  # H7
    assert "runs retry: retried 1 run(s), 0 refused, 0 left to their parent" in printed
    assert _status(db_url, info.runs["H7"]) == "RUNNING"
    rows = _audit(db_url)
    assert [(a, c) for a, _t, c, _cmd, _r in rows] == [
        ("runs cancel", {"chunk": 1, "skipped": 0, "cancelled": 1}),
        ("runs cancel", {"chunk": 1, "skipped": 0, "cancelled": 1}),
        ("lease sweep", {"busy": 0, "leases_expired": 2}),
        ("lease sweep", {"busy": 0, "leases_expired": 0}),
        ("partitions ensure", {"created": 4}),
        ("runs retry", {"reset": 2, "created": 1}),     # extract_a and load reset; extract_a runs at once
    ]
    for action, _t, _c, command, db_role in rows:
        name = command.split()[2]
        (record,) = sorted((out / "runbooks" / name).glob("*.ipynb"))
        assert db_role == role and command.endswith(f"[record {record}]"), (action, command)


def test_timers_overdue_names_the_overdue_timer_and_acts_on_nothing(db_url: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """L4's WAIT timer an hour overdue (no coordinator ran since): the runbook, as the
    reader, alerts and lists it in its diagnosis and plan; asked to act, it says there is
    nothing to do from here but start a coordinator, and changes nothing."""
    info = seed_committed(db_url)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_instances SET wake_at = now() - interval '1 hour' "
                     "WHERE run_id = %s AND state = 'WAITING'", (info.runs["L4"],))
    out = tmp_path / "reports"
    code, printed, err = _run(["timers_overdue", "-p", "confirm", "true", "--database-url", as_role(db_url),
                               "--out", str(out)], capsys)
    assert code == 0, err
    text = _record(out, "timers_overdue").read_text(encoding="utf-8")
    assert "check timers overdue: ALERT" in text and info.runs["L4"] in text and "cool_off" in text
    assert "Nothing to act on from here:" in text and "start a coordinator" in text
    assert _audit(db_url) == []


def test_schedule_late_triggers_the_schedules_it_names(db_url: str, operator: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from composer_ops import Engine

    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy({"id": "nightly", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        engine.schedules.create("nightly-eu", workflow="nightly", cron="0 2 * * *", timezone="Europe/Paris")
    out = tmp_path / "reports"
    code, printed, err = _run(["schedule_late", "-p", "trigger", '["nightly-eu"]', "--database-url",
                               as_role(db_url, operator), "--out", str(out)], capsys)
    assert code == 0 and [r[0] for r in _audit(db_url)] == ["schedules create"], err     # a dry run
    code, printed, err = _run(["schedule_late", "-p", "confirm", "true", "-p", "trigger", '["nightly-eu"]',
                               "--database-url", as_role(db_url, operator), "--out", str(out)], capsys)
    assert code == 0, err
    actions = [(a, t, c) for a, t, c, _cmd, _r in _audit(db_url)]
    assert actions[1:] == [("schedules trigger", "nightly-eu", {"runs": 1})]
    command = _audit(db_url)[1][3]
    record = sorted((out / "runbooks" / "schedule_late").glob("*.ipynb"))[-1]
    assert command.startswith("composer-ops runbook schedule_late -p confirm true") and f"[record {record}]" in command
    assert "schedules trigger: started run(s) " in printed


@pytest.mark.parametrize("argv, message", [
    (["nosuch"], "unknown runbook 'nosuch'"),
    (["sweeper_lag", "-p", "confirm", "maybe"], "-p confirm: 'maybe' is not a boolean"),
    (["sweeper_lag", "-p", "sweeper_lag_s", "-5"], "-p sweeper_lag_s: must be a number >= 0"),
    (["sweeper_lag", "-p", "sweeper_lag_s", "-1.5"], "-p sweeper_lag_s: must be a number >= 0, got -1.5"),
    (["sweeper_lag", "-p", "sweeper_lag_s", "inf"], "-p sweeper_lag_s: must be a finite number of at most"),
    (["downstream_overloaded", "-p", "queue_paused_h", "inf"], "-p queue_paused_h: must be a finite number"),
    (["sweeper_lag", "-p", "sweeper_lag_s", "soon"], "-p sweeper_lag_s: 'soon' is not a number for runbook "
                                                      "sweeper_lag"),
    (["sweeper_lag", "-p", "cutoff", "6 months"], "-p cutoff: no selected runbook declares it"),
    (["long_waits", "-p", "cancel_runs", '["not-a-run"]'], "-p cancel_runs:"),
    (["replay_failed", "-p", "since", "yesterday"], "-p since:"),
    (["schedule_late", "-p", "trigger", '["no spaces"]'], "-p trigger: schedule name"),
])
def test_bad_input_is_refused_before_a_kernel_starts(argv: list[str], message: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, printed, err = _run([*argv, "--database-url", "postgresql://nobody@/nowhere?host=/nonexistent",
                               "--out", str(tmp_path / "reports")], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "reports").exists()


def test_the_reader_plans_a_retry_without_the_locks_its_dry_run_takes(db_url: str, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    info = seed_committed(db_url)
    out = tmp_path / "reports"
    code, printed, err = _run(["replay_failed", "-p", "since", "2025-03-01", "-p", "workflow", "nightly-report",
                               "--database-url", as_role(db_url), "--out", str(out)], capsys)
    assert code == 0 and "dry run: nothing was changed" in printed, err
    text = _record(out, "replay_failed").read_text(encoding="utf-8")
    assert "the read-only role cannot take the run locks this dry run takes" in text
    assert info.runs["H7"] in text and "Traceback" not in text
    assert _status(db_url, info.runs["H7"]) == "FAILED" and _audit(db_url) == []


def test_a_runbook_that_only_reads_does_not_offer_to_act(db_url: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """find_run acts on nothing: its run used to end with 'to act as planned: ...
    -p confirm true', a command that would change nothing."""
    code, printed, err = _run(["find_run", "-p", "where", "input.customer=1", "--database-url", as_role(db_url),
                               "--out", str(tmp_path / "reports")], capsys)
    assert code == 0, err
    assert "to act as planned" not in printed and "read only: this runbook changes nothing (nothing:" in printed
    text = _record(tmp_path / "reports", "find_run").read_text(encoding="utf-8")
    assert "database_url&#x27;: None" not in text and "'database_url': None" not in text   # no dict shown


def test_an_unwritable_out_directory_is_one_line_and_exit_2(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    code, printed, err = _run(["sweeper_lag", "--database-url", "postgresql://nobody@/nowhere?host=/nonexistent",
                               "--out", str(blocker / "reports")], capsys)
    assert code == 2 and err.count("\n") == 1 and "--out: directory" in err and "cannot write there" in err, err


def test_downstream_overloaded_plans_then_pauses_the_queue_with_its_audit_row(
        db_url: str, operator: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed_committed(db_url)
    out = tmp_path / "reports"
    role, operator = operator, as_role(db_url, operator)
    params = ["-p", "queue", "payments", "-p", "action", "pause", "-p", "reason", "provider 503s"]
    code, printed, err = _run(["downstream_overloaded", *params, "--database-url", operator, "--out", str(out)],
                              capsys)
    assert code == 0 and "dry run: nothing was changed" in printed, err
    assert _audit(db_url) == []
    # The command the dry run says acts as planned: its parameters, and confirm.
    (again,) = re.findall(r"to act as planned: (.*) \(with the same --database-url\)$", printed, re.M)
    assert again in _record(out, "downstream_overloaded").with_suffix(".ipynb").read_text(encoding="utf-8")
    words = shlex.split(again)
    assert words[:2] == ["composer-ops", "runbook"] and words[-3:] == ["-p", "confirm", "true"]
    code, printed, err = _run([*words[2:], "--database-url", operator, "--out", str(out)], capsys)
    assert code == 0, err
    assert 'did: queues pause: queue payments' in printed
    ((action, target, counts, command, db_role),) = _audit(db_url)
    assert (action, target, counts, db_role) == ("queues pause", "payments", {"changed": 1}, role)
    assert command.startswith("composer-ops runbook downstream_overloaded")
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT paused, reason FROM queue_settings").fetchall() == [(True, "provider 503s")]


def test_the_lease_runbooks_diagnose_a_lease_at_infinity(db_url: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A lease expiry set to 'infinity' by hand (odd data) is read, not a failed diagnosis."""
    info = seed_committed(db_url)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_instances SET lease_expires_at = 'infinity' WHERE run_id = %s", (info.runs["L1"],))
    out = tmp_path / "reports"
    for name in ("sweeper_lag", "dead_worker"):
        code, printed, err = _run([name, "--database-url", as_role(db_url), "--out", str(out)], capsys)
        assert code == 0 and "dry run: nothing was changed" in printed, (name, err)
    text = _record(out, "sweeper_lag").read_text(encoding="utf-8")
    assert "odd data: 2 RUNNING task(s) without a lease or with an infinite one" in text
