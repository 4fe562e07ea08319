"""WAIT ``until`` at the database's edges: out-of-range literals never reach a table,
a reference that resolves out of range fails its node and the run stays readable,
and the extreme instants that are accepted read back under any session TimeZone."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.types.json import Jsonb

from composer_ops import Engine, Invalid
from composer_ops.cli import main

REF = {"id": "until-ref", "nodes": [{"id": "w", "type": "WAIT", "until": "$.input.at"}]}


@pytest.fixture
def engine(engine: Engine) -> Engine:
    engine.deploy(REF)
    return engine


def test_an_out_of_range_literal_is_refused_by_deploy_and_the_cli(engine: Engine, db_url: str, tmp_path: object,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    spec = {"id": "until-lit", "nodes": [{"id": "w", "type": "WAIT", "until": "9999-12-31T23:59:59-23:59"}]}
    with pytest.raises(Invalid, match='node "w": until'):
        engine.deploy(spec)
    path = f"{tmp_path}/spec.json"
    with open(path, "w", encoding="utf-8") as out:
        out.write(str(spec).replace("'", '"'))
    assert main(["deploy", path, "--database-url", db_url]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM workflow_definitions WHERE id = 'until-lit'").fetchone() == (0,)


@pytest.mark.parametrize("at", ["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+01:00"])
def test_a_reference_out_of_range_fails_the_node_and_the_run_stays_readable(engine: Engine, at: str) -> None:
    run_id = engine.start("until-ref", input={"at": at})
    run = engine.get_run(run_id)
    assert run.status == "FAILED" and "outside the instants the database can store" in str(run.error)
    assert [(t.node_id, t.state, t.wake_at) for t in run.tasks] == [("w", "FAILED", None)]


def test_a_stored_definition_with_an_out_of_range_literal_fails_at_run_time(engine: Engine, db_url: str) -> None:
    """A definition stored before the deploy-time check (or written by hand)."""
    bad = {"id": "until-old", "nodes": [{"id": "w", "type": "WAIT", "until": "9999-12-31T23:59:59-23:59"}]}
    with psycopg.connect(db_url) as conn:
        conn.execute("INSERT INTO workflow_definitions (id, name, version, spec_json, created_by, deployed) "
                     "VALUES ('until-old', 'until-old', 1, %s, 'test', true)", (Jsonb(bad),))
    run_id = engine.start("until-old")
    run = engine.get_run(run_id)
    assert run.status == "FAILED" and [t.state for t in run.tasks] == ["FAILED"]


@pytest.mark.parametrize("tz", ["Pacific/Kiritimati", "Etc/GMT+12", "America/New_York"])
@pytest.mark.parametrize("at", ["9999-12-30T23:59:59Z", "0001-01-02T00:00:00Z"])
def test_the_accepted_extremes_read_back_in_any_session_time_zone(db_url: str, tz: str, at: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGTZ", tz)
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy(REF)
        run_id = engine.start("until-ref", input={"at": at})
        task = engine.get_run(run_id).tasks[0]
    assert task.state == "WAITING" and task.wake_at is not None
