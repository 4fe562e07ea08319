"""``composer-ops schedules ...`` (composer_ops/cli/schedule_cmds.py): bad input is one
line and exit 2 with nothing written; each action prints, says --json, and is audited;
none changes anything without --yes."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main


def _sql(db_url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url) as conn:
        return conn.execute(query.encode()).fetchall()


@pytest.fixture
def url(db_url: str) -> str:
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy({"id": "nightly", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    with psycopg.connect(db_url) as conn:         # the backfill's days may be last month's
        conn.execute("SELECT composer_ensure_partitions_from((now() - interval '40 days')::date, 3)")
    return db_url


@pytest.mark.parametrize(("args", "message"), [
    (["--cron", "0 2 * * 9", "--timezone", "UTC"], "cron '0 2 * * 9': field 5 (day-of-week) '9' is not valid"),
    (["--cron", "0 2 * *", "--timezone", "UTC"], "has 4 field(s); it needs 5"),
    (["--cron", "0 2 * * *", "--timezone", "Europe/Nowhere"], "time zone 'Europe/Nowhere' is unknown"),
    (["--cron", "0 2 * * *", "--timezone", "UTC", "--overlap", "queue"], "argument --overlap: invalid choice"),
    (["--cron", "0 2 * * *", "--timezone", "UTC", "--catchup", "some"], "argument --catchup: invalid choice"),
    (["--cron", "0 2 * * *", "--timezone", "UTC", "--input", "{"], "--input"),
    (["--cron", "0 2 * * *", "--timezone", "UTC", "--input", "3"], "--input must be a JSON object"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(url: str, args: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(["schedules", "create", "n", "--workflow", "nightly", *args, "--database-url", url]))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and err.count("\n") == 1
    assert _sql(url, "SELECT (SELECT count(*) FROM schedules), (SELECT count(*) FROM operator_audit)") == [(0, 0)]


def test_create_list_trigger_backfill_pause_resume_delete(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    def run(*argv: str) -> tuple[int, str]:
        code = main([*argv, "--database-url", url])
        return code, capsys.readouterr().out

    create = ("schedules", "create", "nightly-eu", "--workflow", "nightly", "--cron", "0 2 * * *",
              "--timezone", "Europe/Paris", "--input", '{"region": "eu"}', "--overlap", "buffer_one",
              "--catchup", "all")
    # Without --yes: checked, said, nothing written.
    code, out = run(*create)
    assert code == 0 and out.startswith("would create schedule nightly-eu: nightly at '0 2 * * *' in Europe/Paris")
    assert "nothing was changed (add --yes to create)" in out
    assert _sql(url, "SELECT (SELECT count(*) FROM schedules), (SELECT count(*) FROM operator_audit)") == [(0, 0)]
    code, out = run(*create, "--yes")
    assert code == 0 and out.startswith("created schedule nightly-eu: nightly at '0 2 * * *' in Europe/Paris")
    code, out = run("schedules", "create", "nightly-eu", "--workflow", "nightly", "--cron", "0 2 * * *",
                    "--timezone", "UTC", "--yes")
    assert code == 1 and _sql(url, "SELECT count(*) FROM schedules") == [(1,)]         # Conflict
    code, out = run("schedules", "create", "nightly-eu", "--workflow", "nightly", "--cron", "0 2 * * *",
                    "--timezone", "UTC")
    assert code == 1, out                                                               # the dry run says so too
    code, out = run("schedules", "trigger", "nightly-eu")
    assert (code, out) == (0, "would start one run of schedule nightly-eu now; nothing was changed "
                              "(add --yes to start it)\n")
    assert _sql(url, "SELECT count(*) FROM workflow_runs") == [(0,)]
    code, out = run("schedules", "trigger", "nightly-eu", "--yes", "--json")
    run_id = json.loads(out)["run_id"]
    assert code == 0 and _sql(url, f"SELECT input_json->>'region' FROM workflow_runs WHERE id = '{run_id}'") == [
        ("eu",)]
    code, out = run("schedules", "backfill", "nightly-eu", "--from", "3d", "--to", "1d", "--json")
    slots = json.loads(out)["slots"]
    assert code == 0 and len(slots) >= 1 and {s["action"] for s in slots} == {"start"}
    code, out = run("schedules", "backfill", "nightly-eu", "--from", "3d", "--to", "1d")
    assert code == 0 and f"would start {len(slots)} run(s) of {len(slots)} slot(s); nothing was changed" in out
    code, out = run("schedules", "backfill", "nightly-eu", "--from", "3d", "--to", "1d", "--yes", "--json")
    assert code == 0 and json.loads(out)["started"] == len(slots)
    code, out = run("schedules", "list", "--json")
    [listed] = json.loads(out)
    assert (listed["name"], listed["last_run_id"], listed["overlap"], listed["catchup"]) == (
        "nightly-eu", run_id, "buffer_one", "all")
    assert run("schedules", "pause", "nightly-eu") == (
        0, "would pause schedule nightly-eu; nothing was changed (add --yes to pause)\n")
    assert "paused" not in run("schedules", "list")[1]
    assert run("schedules", "pause", "nightly-eu", "--yes") == (0, "paused schedule nightly-eu\n")
    code, out = run("schedules", "list")
    assert code == 0 and "nightly-eu  nightly  '0 2 * * *' Europe/Paris" in out and "paused" in out
    code, out = run("schedules", "resume", "nightly-eu", "--yes")
    assert code == 0 and out.startswith("resumed schedule nightly-eu; next slot ")
    code, out = run("schedules", "delete", "nightly-eu")
    assert code == 0 and "nothing was changed (add --yes to delete)" in out
    assert run("schedules", "delete", "nightly-eu", "--yes")[0] == 0
    assert run("schedules", "list") == (0, "no schedule\n")
    assert run("schedules", "trigger", "nightly-eu")[0] == 2                            # NotFound
    assert [r[0] for r in _sql(url, "SELECT action FROM operator_audit ORDER BY id")] == [
        "schedules create", "schedules trigger", "schedules backfill", "schedules pause", "schedules resume",
        "schedules delete"]
    commands = [r[0] for r in _sql(url, "SELECT command FROM operator_audit ORDER BY id")]
    assert commands[0].startswith("composer-ops schedules create nightly-eu")
