"""``runs list``: selection by workflow, status, creation window and input containment;
the window prunes partitions (EXPLAIN); bad selections are one-line errors, exit 2."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.core.filters import RunFilter
from composer_ops.errors import Invalid
from composer_ops.repo import partitions, runs
from tests.integration.helpers import add_definition, uuid7_at


def _runs_of(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """Runs in five months of 2025, two workflows, several statuses and inputs; by label."""
    conn.execute("SELECT composer_ensure_partitions_from(%s, 5)", (date(2025, 1, 1),))
    add_definition(conn, "orders")
    add_definition(conn, "reports")
    made: dict[str, str] = {}
    rows = [
        ("jan", "orders", datetime(2025, 1, 10, tzinfo=UTC), "SUCCEEDED", {"customer": 42, "tier": "gold"}),
        ("jan-late", "orders", datetime(2025, 1, 31, 23, 30, tzinfo=UTC), "FAILED", {"customer": 42}),
        ("feb-early", "orders", datetime(2025, 2, 1, 0, 30, tzinfo=UTC), "FAILED", {"customer": 7}),
        ("feb", "reports", datetime(2025, 2, 15, tzinfo=UTC), "SUCCEEDED", {"customer": 42, "nested": {"a": [1, 2]}}),
        ("mar", "orders", datetime(2025, 3, 3, tzinfo=UTC), "RUNNING", {"customer": 42, "tier": "silver"}),
        ("apr", "orders", datetime(2025, 4, 20, tzinfo=UTC), "CANCELLED", {"customer": "42"}),
        ("may", "reports", datetime(2025, 5, 5, tzinfo=UTC), "FAILED", None),
    ]
    for label, wf, at, status, payload in rows:
        run_id = uuid7_at(at)
        runs.insert_run(conn, run_id=run_id, workflow_id=wf, workflow_version=1, input=payload,
                        context={"input": payload, "config": {}}, now=at)
        conn.execute("UPDATE workflow_runs SET status = %s WHERE id = %s", (status, run_id))
        made[label] = run_id
    return made


@pytest.fixture
def seeded(db_url: str) -> dict[str, str]:
    with psycopg.connect(db_url) as conn:
        made = _runs_of(conn)
        conn.commit()
    return made


def _labels(made: dict[str, str], rows: list[Any]) -> list[str]:
    by_id = {v: k for k, v in made.items()}
    return [by_id[r.id] for r in rows]


def test_selections(db_url: str, seeded: dict[str, str]) -> None:
    with Engine.connect(db_url, pool_size=1) as engine:
        def labels(**kw: Any) -> list[str]:
            return _labels(seeded, engine.find_runs(**kw))

        assert labels() == ["may", "apr", "mar", "feb", "feb-early", "jan-late", "jan"]       # newest first
        assert labels(limit=2) == ["may", "apr"]
        assert labels(workflow="reports") == ["may", "feb"]
        assert labels(status="failed,cancelled") == ["may", "apr", "feb-early", "jan-late"]
        assert labels(status=["RUNNING", "SUCCEEDED"]) == ["mar", "feb", "jan"]
        # The window is in UTC whatever the session's TimeZone (the suite's is America/New_York).
        assert labels(since="2025-02-01", until="2025-04-01") == ["mar", "feb", "feb-early"]
        assert labels(until="2025-02-01") == ["jan-late", "jan"]
        assert labels(since=datetime(2025, 4, 20, tzinfo=UTC)) == ["may", "apr"]
        # Input containment: JSON types matter (42 is not "42"), nested documents and arrays are contained.
        assert labels(where="input.customer=42") == ["mar", "feb", "jan-late", "jan"]
        assert labels(where='input.customer="42"') == ["apr"]
        assert labels(where="input.customer=42 and input.tier=gold") == ["jan"]
        assert labels(where="input.nested.a=[2]") == ["feb"]
        assert labels(where={"tier": "silver"}, status="RUNNING") == ["mar"]
        assert labels(where="input.customer=42", since="2025-02-01", workflow="orders") == ["mar"]
        assert labels(since="1d") == []        # ages count back from the database clock
        with pytest.raises(Invalid, match="until"):
            engine.find_runs(since="2025-03-01", until="2025-02-01")
        with pytest.raises(Invalid, match="limit"):
            engine.find_runs(limit=0)


def _relations(plan: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(plan, dict):
        if "Relation Name" in plan:
            found.add(plan["Relation Name"])
        for value in plan.values():
            found |= _relations(value)
    elif isinstance(plan, list):
        for value in plan:
            found |= _relations(value)
    return found


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
def test_the_window_reads_only_the_months_in_it(db_url: str, seeded: dict[str, str], generic: bool) -> None:
    """The statement runs list executes, EXPLAINed: only February and March are planned
    (a generic plan prunes the rest when it starts, which EXPLAIN reports as removed)."""
    window = RunFilter(since=datetime(2025, 2, 1, tzinfo=UTC), until=datetime(2025, 4, 1, tzinfo=UTC),
                       contains={"customer": 42})
    with psycopg.connect(db_url) as conn:
        if generic:
            conn.execute("SET plan_cache_mode = force_generic_plan")
        query, params = runs.find_runs_query(window, limit=50)
        explain = b"EXPLAIN (FORMAT JSON) " + query.as_bytes(conn)
        plan = conn.execute(explain, params, prepare=generic).fetchone()[0]  # type: ignore[index]
        touched = _relations(plan)
        assert touched == {"workflow_runs_p202502", "workflow_runs_p202503"}, touched
        # Without a window every month is planned: the assertion above can fail.
        query, params = runs.find_runs_query(RunFilter(contains={"customer": 42}), limit=50)
        plan = conn.execute(b"EXPLAIN (FORMAT JSON) " + query.as_bytes(conn), params).fetchone()[0]  # type: ignore[index]
        assert {"workflow_runs_p202501", "workflow_runs_p202505"} <= _relations(plan)


def test_cli_runs_list(db_url: str, seeded: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "list", "--database-url", db_url, "--where", "input.customer=42", "--status", "FAILED",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in out] == [seeded["jan-late"]]
    assert out[0]["input"] == {"customer": 42} and out[0]["workflow_id"] == "orders"
    assert main(["runs", "list", "--database-url", db_url, "--since", "2025-05-01"]) == 0
    text = capsys.readouterr().out
    assert seeded["may"] in text and "1 run(s)" in text
    # An incident's window, in minutes, counted back from the database clock (the seed's runs are older).
    assert main(["runs", "list", "--database-url", db_url, "--since", "10min", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    with psycopg.connect(db_url) as conn:
        assert partitions.age_before_now(conn, minutes=10) == conn.execute(
            "SELECT now() - interval '10 minutes'").fetchone()[0]    # type: ignore[index]
    assert main(["runs", "list", "--database-url", db_url, "--since", "10m"]) == 2     # minutes or months?
    assert "unknown unit 'm'" not in (err := capsys.readouterr().err) and "10min" in err, err
    for bad in (["--where", "input.customer=42 or input.x=1"], ["--where", "customer=42"], ["--status", "DONE"],
                ["--since", "last tuesday"], ["--limit", "0"], ["--where", "input.a='x'"]):
        assert main(["runs", "list", "--database-url", db_url, *bad]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("composer-ops: invalid: ") and err.count("\n") == 1, err
