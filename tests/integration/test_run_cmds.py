"""``runs show`` as an on-call engineer reads it: a run whose month was dropped points at
the archive, output is JSON, attempts after a retry are told apart from the first ones,
and the JSON instants are ISO 8601 with the ``T`` and the UTC offset."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.core.actor import Actor
from composer_ops.core.runids import month_of
from composer_ops.testing import fixtures

#: An instant as the CLI's JSON writes it.
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00$")


def test_a_run_of_a_month_without_partitions_points_at_the_archive(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    gone = fixtures.uuid7_text(datetime(2021, 3, 4, tzinfo=UTC), 1)      # no partition holds March 2021
    assert main(["runs", "show", gone, "--database-url", db_url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    assert f"composer-ops partitions restore {month_of(gone)} --from DIR" in err[0] and month_of(gone) == "202103"


def test_a_missing_run_in_a_month_that_exists_gets_no_archive_hint(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with Engine.connect(db_url) as engine:
        engine.deploy({"id": "w", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        run = engine.start("w", input={})
    missing = run[:-4] + ("0000" if not run.endswith("0000") else "0001")
    assert main(["runs", "show", missing, "--database-url", db_url]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "partitions restore" not in err


def test_runs_show_prints_json_output_and_tells_retried_attempts_apart(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy({"id": "w", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        run = engine.start("w", input={"k": 1})
        [claim] = engine.claim(["default"], "w-one", 1)
        engine.fail(claim, "boom", retryable=False)
        engine.retry(run, yes=True, actor=Actor(command="composer-ops runs retry RUN --yes"))
        [claim] = engine.claim(["default"], "w-two", 1)
        engine.complete(claim, {"tier": "gold", "n": [1, 2]})
    assert main(["runs", "show", run, "--database-url", db_url]) == 0
    text = capsys.readouterr().out
    output = next(line for line in text.splitlines() if line.startswith("output: "))
    assert json.loads(output.removeprefix("output: ")) == {"a": {"tier": "gold", "n": [1, 2]}}   # JSON, not a dict
    lines = [line for line in text.splitlines() if "w-one" in line or "w-two" in line]
    first = next(line for line in lines if "w-one" in line and "failed" in line)
    second = next(line for line in lines if "w-two" in line and "completed" in line)
    assert "(retry 1)" in second and "(retry" not in first
    assert main(["runs", "show", run, "--json", "--database-url", db_url]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(a["worker"], a["attempt"], a["retry"]) for a in shown["attempts"]] == [("w-one", 0, 0), ("w-two", 0, 1)]
    instants = [shown["created_at"], shown["completed_at"], *(h["at"] for h in shown["history"]),
                *(a["claimed_at"] for a in shown["attempts"])]
    assert instants and all(ISO.match(t) for t in instants), instants


def test_runs_show_reads_a_lease_at_infinity(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A lease expiry set to 'infinity' by hand (odd data) is shown, not refused."""
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy({"id": "w", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        run = engine.start("w", input={})
        engine.claim(["default"], "w-one", 1)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_instances SET lease_expires_at = 'infinity' WHERE run_id = %s", (run,))
    assert main(["runs", "show", run, "--database-url", db_url]) == 0
    assert "RUNNING" in capsys.readouterr().out
    assert main(["runs", "show", run, "--json", "--database-url", db_url]) == 0
    (task,) = json.loads(capsys.readouterr().out)["tasks"]
    assert task["state"] == "RUNNING" and task["lease_expires_at"].startswith("9999-12-31T23:59:59")
