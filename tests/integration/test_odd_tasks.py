"""Odd data an event meets: a task for a node its run's definition does not have (a
hand edit of the task or of the definition). No later event resolves it, so the
engine says so once per run at WARNING (before: at INFO, as for any late report,
and at every sweep of its lapsed lease), and changes nothing."""

from __future__ import annotations

import dataclasses
import json
import logging

import psycopg
import pytest

from composer_ops import Engine

SPEC = {"id": "odd-one", "nodes": [{"id": "work", "type": "TASK", "task": "work"}]}


def test_a_task_for_a_node_not_in_its_definition_is_warned_of_once(engine: Engine, db_url: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    engine.deploy(SPEC)
    run_id = engine.start("odd-one")
    (claim,) = engine.claim(["default"], "w1", 1)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_instances SET node_id = 'renamed' WHERE id = %s", (claim.task_id,))
    claim = dataclasses.replace(claim, node_id="renamed")
    with caplog.at_level(logging.INFO, logger="composer_ops.engine.shell"):
        first = engine.complete(claim, {"done": True})
        second = engine.fail(claim, "again")
    assert first.stale and second.stale
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warned] == [
        f'run {run_id}: run {run_id} has a task for node "renamed", which its definition odd-one v1 does not have: '
        "odd data, left as it is (the run_investigation report shows it; cancel the run to end it)"]
    assert any(r.levelno == logging.INFO and "stale event" in r.getMessage() for r in caplog.records)
    run = engine.get_run(run_id)
    assert run.status == "RUNNING" and [(t.node_id, t.state) for t in run.tasks] == [("renamed", "RUNNING")]


def test_runs_show_says_when_a_runs_definition_version_is_gone(engine: Engine, db_url: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Before, `runs show` printed `v99 RUNNING` as for any run (an on-call tester's
    finding); the run_investigation report was the only place that said why it is stuck."""
    from composer_ops.cli import main

    engine.deploy(SPEC)
    run_id = engine.start("odd-one")
    assert engine.get_run(run_id).definition_found
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE workflow_runs SET workflow_version = 99 WHERE id = %s", (run_id,))
    assert not engine.get_run(run_id).definition_found
    assert main(["runs", "show", run_id, "--database-url", db_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("odd-one v99  RUNNING")
    assert out[1] == ("odd data: odd-one v99 is not in workflow_definitions, so no event of this run can be decided "
                      "(restore that version's definition row, or cancel the run)")
    assert main(["runs", "show", run_id, "--json", "--database-url", db_url]) == 0
    assert json.loads(capsys.readouterr().out)["definition_found"] is False
