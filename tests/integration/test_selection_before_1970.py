"""Selections whose window starts or ends before 1970 (the UUIDv7 epoch) or far in the
past: ``--since`` before it selects every run, ``--until`` before it selects none, in
``runs list``, ``runs cancel`` and ``runs retry`` alike."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from composer_ops import Engine
from composer_ops.cli import main

SPEC = {"id": "shop", "nodes": [{"id": "pay", "type": "TASK", "task": "pay"}]}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=2) as e:
        e.deploy(SPEC)
        yield e


@pytest.mark.parametrize("since", ["100y", "57y", "1969-12-31", "1900-01-01T00:00:00Z", "0001-01-01", "3000y",
                                   "999999y", "999999w", "999999h"])
def test_runs_list_since_before_1970_lists_every_run(db_url: str, engine: Engine, since: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    started = sorted(engine.start("shop", input={"i": i}) for i in range(3))
    assert main(["runs", "list", "--database-url", db_url, "--since", since, "--json"]) == 0
    assert sorted(r["run_id"] for r in json.loads(capsys.readouterr().out)) == started


@pytest.mark.parametrize("until", ["1969-12-31", "100y", "1970-01-01", "999999mo"])
def test_runs_cancel_until_before_1970_selects_none(db_url: str, engine: Engine, until: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    started = [engine.start("shop", input={"i": i}) for i in range(3)]
    base = ["runs", "cancel", "--database-url", db_url, "--until", until]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "would cancel 0 active run(s)" in out, out
    assert main([*base, "--yes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cancelled"] == []
    assert {engine.get_run(r).status for r in started} == {"RUNNING"}
    assert main(["runs", "list", "--database-url", db_url, "--until", until, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_runs_retry_shares_the_clamped_selection(db_url: str, engine: Engine,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run_id = engine.start("shop")
    engine.cancel(run_id, reason="for the test")
    base = ["runs", "retry", "--database-url", db_url, "--status", "CANCELLED", "--json"]
    assert main([*base, "--until", "1969-12-31"]) == 0
    assert json.loads(capsys.readouterr().out) == {"retried": [], "refused": [], "left_to_parent": []}
    assert main([*base, "--since", "100y"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["retried"]] == [run_id]
