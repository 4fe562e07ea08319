"""The CLI: happy paths, and bad input as one line, exit code 2, nothing written."""

from __future__ import annotations

import json
import re
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from composer_ops.cli import main
from composer_ops.testing.processes import APP
from tests.integration.helpers import uuid7_at

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "order_fulfilment.json")


def run(capsys: pytest.CaptureFixture[str], db_url: str, *argv: str) -> tuple[int, str, str]:
    code = main([argv[0], *(["--database-url", db_url] if argv[0] not in ("runs", "partitions") else []),
                 *argv[1:]]) if argv[0] not in ("runs", "partitions") else main(
        [*argv[:2], "--database-url", db_url, *argv[2:]])
    out, err = capsys.readouterr()
    return code, out, err


def counts(db_url: str) -> tuple[int, ...]:
    with psycopg.connect(db_url) as conn:
        row: Any = conn.execute("""SELECT (SELECT count(*) FROM workflow_definitions),
                                          (SELECT count(*) FROM workflow_runs),
                                          (SELECT count(*) FROM task_instances),
                                          (SELECT count(*) FROM workflow_events),
                                          (SELECT count(*) FROM task_outbox)""").fetchone()
        return tuple(row)


def test_deploy_start_signal_show_cancel(capsys: pytest.CaptureFixture[str], db_url: str) -> None:
    assert run(capsys, db_url, "deploy", EXAMPLE)[:2] == (0, "deployed order-fulfilment v1\n")
    code, out, _ = run(capsys, db_url, "start", "order-fulfilment", "--input", '{"amount": 120}')
    run_id = out.strip()
    assert code == 0 and len(run_id) == 36
    assert run(capsys, db_url, "signal", run_id, "delivered", "--payload", '{"by": "courier"}')[0] == 0
    code, out, _ = run(capsys, db_url, "runs", "show", run_id, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["status"] == "RUNNING" and shown["tasks"][0]["node_id"] == "charge"
    assert run(capsys, db_url, "cancel", run_id)[:2] == (0, "cancelled\n")
    code, _, err = run(capsys, db_url, "cancel", run_id)
    assert code == 1 and err.count("\n") == 1 and "CANCELLED" in err


def test_stored_text_reaches_the_terminal_as_text(capsys: pytest.CaptureFixture[str], db_url: str) -> None:
    """A reason, an error or a name holding terminal escapes (a colour, a window title, a
    hidden link, a right-to-left override) is printed escaped, in the text output and in
    the error line; the JSON output escapes them as JSON does."""
    payload = "\x1b]0;pwned\x07\x1b[2J\u202egnp.exe"
    run(capsys, db_url, "deploy", EXAMPLE)
    run_id = run(capsys, db_url, "start", "order-fulfilment", "--input", '{"amount": 1}')[1].strip()
    assert run(capsys, db_url, "cancel", run_id, "--reason", payload)[0] == 0
    code, out, _ = run(capsys, db_url, "runs", "show", run_id)
    assert code == 0 and "\\x1b]0;pwned\\x07\\x1b[2J\\u202egnp.exe" in out, out
    assert not any(c in out for c in "\x1b\x07\u202e"), out
    code, out, _ = run(capsys, db_url, "runs", "show", run_id, "--json")
    assert code == 0 and json.loads(out)["error"] == {"error": payload}, out
    code, _, err = run(capsys, db_url, "cancel", run_id, "--reason", payload)
    assert code == 1 and "\x1b" not in err and err.count("\n") == 1, err


def _bad_spec(tmp_path: Path, text: str, name: str = "bad.json") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("argv", "message"), [
    (["deploy", "/nonexistent.json"], "no such file"),
    (["deploy", "{bad}"], "no such file"),
    (["start", "order-fulfilment", "--input", "{not json"], "--input is not valid JSON"),
    (["start", "missing-workflow"], "does not exist"),
    (["start", "order-fulfilment", "--version", "9"], "v9 does not exist"),
    (["start", "order-fulfilment", "--run-id", "not-a-uuid"], "not a canonical"),
    (["start", "order-fulfilment", "--input", '{"a": "\\u0000"}'], "NUL character"),
    (["signal", "0190f0c0-0000-7000-8000-000000000000", "delivered"], "does not exist"),
    (["signal", "not-a-uuid", "delivered"], "argument RUN: run id 'not-a-uuid' is not a UUID: expected"),
    (["cancel", "3f2b8c1e-8d4b-4e7a-9c2d-1a2b3c4d5e6f"], "is a version 4 UUID, not a UUIDv7"),
    (["runs", "show", "0190f0c0-0000-7000-8000"], "argument RUN: run id '0190f0c0-0000-7000-8000' is not a UUID"),
    (["runs", "show", "0190f0c0-0000-7000-8000-000000000000"], "does not exist"),
    (["partitions", "ensure", "--months-ahead", "-1"], "--months-ahead"),
    (["worker", "--app", APP, "--connect-wait", "-1"], "--connect-wait must be 0 or more"),
    (["coordinator", "--connect-wait", "-5"], "--connect-wait must be 0 or more"),
    (["coordinator", "--interval", "-1"], "--interval"),
    (["worker", "--app", APP, "--concurrency", "0"], "--concurrency must be at least 1"),
    (["worker", "--app", APP, "--prefetch", "-1"], "--prefetch must be from 0 to 100 tasks, got -1"),
    (["worker", "--app", APP, "--poll-interval", "0"], "--poll-interval must be more than 0 and at most 3600"),
    (["worker", "--app", APP, "--poll-interval", "nan"], "--poll-interval must be more than 0 and at most 3600"),
    (["worker", "--app", "no_such_module_here:w"], "cannot import 'no_such_module_here'"),
    (["worker", "--app", "json:dumps"], "--app json:dumps: calling it with the Engine raised TypeError: "),
    (["deploy", "/"], "/: a directory, not a definition file"),
    (["start"], "the following arguments are required"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
        capsys: pytest.CaptureFixture[str], db_url: str, argv: list[str], message: str) -> None:
    run(capsys, db_url, "deploy", EXAMPLE)
    before = counts(db_url)
    try:
        code, _, err = run(capsys, db_url, *argv)
    except SystemExit as exc:                      # argparse errors exit from inside main
        code, err = int(exc.code or 0), capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert counts(db_url) == before


@pytest.mark.parametrize(("source", "message"), [
    ("def make(:\n", "importing 'broken_app' raised SyntaxError: "),
    ("import nowhere_to_be_found_x\n", "cannot import 'broken_app': No module named 'nowhere_to_be_found_x'"),
    ("VALUE = 1 / 0\n", "importing 'broken_app' raised ZeroDivisionError: division by zero"),
    ("def make():\n    return None\n", "calling it with the Engine raised TypeError: make() takes 0 positional"),
    ("def make(engine):\n    raise KeyError('queue')\n", "calling it with the Engine raised KeyError: 'queue'"),
    ("def make(engine):\n    return 5\n", "expected a Worker or a function returning one, got function returning int"),
])
def test_a_broken_worker_app_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], db_url: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, source: str, message: str) -> None:
    """The --app module's or its factory's own errors: one line naming them, no traceback."""
    (tmp_path / "broken_app.py").write_text(source)
    monkeypatch.chdir(tmp_path)                 # the worker imports --app from the working directory
    monkeypatch.delitem(sys.modules, "broken_app", raising=False)
    code, _, err = run(capsys, db_url, "worker", "--app", "broken_app:make", "--connect-wait", "0")
    assert code == 2 and f"composer-ops: invalid: --app broken_app:make: {message}" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_worker_app_whose_factory_finds_the_database_down_is_an_outage(
        capsys: pytest.CaptureFixture[str], db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not bad input (exit 2): what the engine raises passes through as it is (exit 1)."""
    (tmp_path / "down_app.py").write_text("from composer_ops.errors import Unavailable\n"
                                          "def make(engine):\n    raise Unavailable('the config service is down')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "down_app", raising=False)
    code, _, err = run(capsys, db_url, "worker", "--app", "down_app:make", "--connect-wait", "0")
    assert (code, err) == (1, "composer-ops: unavailable: the config service is down\n")


def test_a_log_level_typo_is_refused(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as typed:
        main(["--log-level", "nope", "workers", "list"])
    assert typed.value.code == 2 and "argument --log-level: invalid choice: 'NOPE'" in capsys.readouterr().err
    monkeypatch.setenv("COMPOSER_LOG_LEVEL", "verbose")
    with pytest.raises(SystemExit) as from_env:
        main(["workers", "list"])
    assert from_env.value.code == 2 and "COMPOSER_LOG_LEVEL: 'VERBOSE' is not one of" in capsys.readouterr().err


def test_a_choice_from_the_environment_is_checked_as_a_typed_one(capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`--progress yes` was refused while COMPOSER_REPORT_PROGRESS=yes was taken silently."""
    monkeypatch.setenv("COMPOSER_REPORT_PROGRESS", "yes")
    assert main(["report", "partition_sizes", "--database-url", "postgresql://nobody@127.0.0.1:1/none"]) == 2
    assert capsys.readouterr().err == ("composer-ops: invalid: --progress must be one of 0, 1 (from "
                                       "COMPOSER_REPORT_PROGRESS), got yes\n")
    monkeypatch.setenv("COMPOSER_REPORT_PROGRESS", "0")
    with pytest.raises(SystemExit) as shown:
        main(["report", "--help"])          # a good value: no complaint
    assert shown.value.code == 0 and capsys.readouterr().err == ""


def test_a_malformed_database_url_is_bad_input_not_an_outage(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 2, not 1: cron and monitoring must not read a typo as the database down."""
    assert main(["workers", "list", "--database-url", "not a url"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("composer-ops: invalid: --database-url (or COMPOSER_DATABASE_URL) is not a libpq URL")
    assert err.count("\n") == 1
    # libpq's reason would quote what it could not parse: a password, here.
    assert main(["workers", "list", "--database-url", "postgresql://u:pa%zzsecret@h/db"]) == 2
    assert "secret" not in capsys.readouterr().err
    monkeypatch.setenv("COMPOSER_DATABASE_URL", "dbname")
    assert main(["check"]) == 2 and "is not a libpq URL" in capsys.readouterr().err


def test_yaml_dates_stay_the_text_written(capsys: pytest.CaptureFixture[str], db_url: str, tmp_path: Path) -> None:
    """An unquoted instant in a YAML definition is the string JSON would hold, not a date."""
    doc = "id: dated\nnodes:\n  - {id: w, type: WAIT, until: 2030-01-01T00:00:00Z}\n"
    code, _, err = run(capsys, db_url, "deploy", _bad_spec(tmp_path, doc, "dated.yaml"))
    assert code == 0, err
    with psycopg.connect(db_url) as conn:
        (spec,) = conn.execute("SELECT spec_json FROM workflow_definitions WHERE id = 'dated'").fetchone() or ()
    assert spec["nodes"][0]["until"] == "2030-01-01T00:00:00Z"


@pytest.mark.parametrize(("doc", "message"), [
    ('{"id": "x", "nodes": [{"id": "a", "type": "NOPE"}]}', 'node "a"'),
    ('{"id": "x", "nodes": [{"id": "a", "type": "TASK"}]}', "task"),
    ('{"id": "x", "nodes": [{"id": "a", "type": "TASK", "task": "t", "depends_on": ["zz"]}]}', "zz"),
    ('{"id": "x", "nodes": [', "not valid JSON"),
    ("id: x\nnodes: [ {id: a, type: WAIT, duration_s: -1} ]\n", "duration_s"),
])
def test_malformed_definitions_are_refused(capsys: pytest.CaptureFixture[str], db_url: str, tmp_path: Path,
                                           doc: str, message: str) -> None:
    name = "bad.yaml" if not doc.startswith("{") else "bad.json"
    code, _, err = run(capsys, db_url, "deploy", _bad_spec(tmp_path, doc, name))
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert counts(db_url) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("delta", [timedelta(hours=-2), timedelta(minutes=30)])
def test_run_ids_too_old_or_too_far_ahead_are_refused(capsys: pytest.CaptureFixture[str], db_url: str,
                                                      delta: timedelta) -> None:
    run(capsys, db_url, "deploy", EXAMPLE)
    run_id = uuid7_at(datetime.now(UTC) + delta)
    code, _, err = run(capsys, db_url, "start", "order-fulfilment", "--run-id", run_id)
    assert code == 2 and ("before the database clock" in err or "after the database clock" in err), err
    assert counts(db_url)[1] == 0


def test_uppercase_run_id_is_refused_and_a_good_one_is_idempotent(capsys: pytest.CaptureFixture[str],
                                                                  db_url: str) -> None:
    run(capsys, db_url, "deploy", EXAMPLE)
    run_id = uuid7_at(datetime.now(UTC))
    code, _, err = run(capsys, db_url, "start", "order-fulfilment", "--run-id", run_id.upper())
    assert code == 2 and "lowercase" in err, err
    assert run(capsys, db_url, "start", "order-fulfilment", "--run-id", run_id)[:2] == (0, run_id + "\n")
    code, _, err = run(capsys, db_url, "start", "order-fulfilment", "--run-id", run_id)
    assert code == 1 and "already exists" in err
    assert counts(db_url)[1] == 1


def test_run_id_without_a_partition_is_refused(capsys: pytest.CaptureFixture[str], db_url: str) -> None:
    run(capsys, db_url, "deploy", EXAMPLE)
    with psycopg.connect(db_url, autocommit=True) as conn:
        month = datetime.now(UTC).strftime("%Y%m")
        conn.execute(f"DROP TABLE workflow_events_p{month}")
        conn.execute(f"DROP TABLE task_instances_p{month}")
        conn.execute(f"ALTER TABLE workflow_runs DETACH PARTITION workflow_runs_p{month}")
        conn.execute(f"DROP TABLE workflow_runs_p{month}")
    code, _, err = run(capsys, db_url, "start", "order-fulfilment", "--run-id", uuid7_at(datetime.now(UTC)))
    assert code == 2 and "no partition holds this run ID's month" in err and "partitions ensure" in err, err


def test_disabled_and_deleted_definitions_refuse_new_runs(capsys: pytest.CaptureFixture[str], db_url: str) -> None:
    from composer_ops import Engine

    run(capsys, db_url, "deploy", EXAMPLE)
    with Engine.connect(db_url, pool_size=1) as engine:
        started = engine.start("order-fulfilment", input={"amount": 1})
        engine.set_enabled("order-fulfilment", False)
        assert run(capsys, db_url, "start", "order-fulfilment")[0] == 2
        engine.set_enabled("order-fulfilment", True)
        engine.delete("order-fulfilment")
        code, _, err = run(capsys, db_url, "start", "order-fulfilment")
        assert code == 2 and "no deployed version" in err
        assert engine.get_run(started).status == "RUNNING"       # runs already started carry on
    assert counts(db_url)[1] == 1


def test_signal_to_a_finished_run_is_a_clear_error(capsys: pytest.CaptureFixture[str], db_url: str) -> None:
    run(capsys, db_url, "deploy", EXAMPLE)
    run_id = run(capsys, db_url, "start", "order-fulfilment")[1].strip()
    run(capsys, db_url, "cancel", run_id)
    before = counts(db_url)
    code, _, err = run(capsys, db_url, "signal", run_id, "delivered")
    assert code == 1 and "CANCELLED" in err and err.count("\n") == 1
    assert counts(db_url) == before


def test_the_worker_options_override_the_apps_worker(capfd: pytest.CaptureFixture[str], db_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What `worker` sets on the Worker its --app made, before it runs."""
    from composer_ops import Worker

    seen: dict[str, Any] = {}

    def run_once(self: Worker) -> None:
        seen.update(concurrency=self.concurrency, prefetch=self.prefetch, poll_interval=self.poll_interval,
                    registry_interval=self.registry_interval)
    monkeypatch.setattr(Worker, "run", run_once)
    # capfd: the worker command reads its streams' file descriptors, which capsys has not
    code, _, err = run(capfd, db_url, "worker", "--app", APP, "--concurrency", "3", "--prefetch", "2",
                       "--poll-interval", "0.25", "--registry-interval", "5", "--connect-wait", "0")
    assert code == 0, err
    assert seen == {"concurrency": 3, "prefetch": 2, "poll_interval": 0.25, "registry_interval": 5.0}
    # Whatever the log level, it says on stderr that it serves, where, and that it stopped;
    # the URL (which may hold a password) is never printed.
    name = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    assert re.search(r"^composer-ops: worker \S+ serving queue\(s\) \S.* \(\d+ task name\(s\)\) with 3 slot\(s\) "
                     rf"on database {name} at \S+; SIGTERM or SIGINT stops it\n"
                     r"composer-ops: worker \S+ stopped\n$", err), err
    assert db_url not in err


def test_the_coordinator_says_it_runs_and_that_it_stopped(db_url: str, capfd: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from composer_ops.engine.coordinator import Coordinator

    monkeypatch.setattr(Coordinator, "run", lambda self: None)     # a loop that ends at once
    code, _, err = run(capfd, db_url, "coordinator", "--interval", "2", "--connect-wait", "0")
    assert code == 0, err
    name = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    assert err == (f"composer-ops: coordinator running every 2s on database {name} at "
                   f"{psycopg.conninfo.conninfo_to_dict(db_url)['host']}; SIGTERM or SIGINT stops it\n"
                   "composer-ops: coordinator stopped\n"), err
