"""Odd data an event meets: a task for a node its run's definition does not have (a
hand edit of the task or of the definition). No later event resolves it, so the
engine says so once per run at WARNING (before: at INFO, as for any late report,
and at every sweep of its lapsed lease), and changes nothing."""

from __future__ import annotations

import dataclasses
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
