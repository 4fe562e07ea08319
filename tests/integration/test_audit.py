"""Every operator action writes one audit row in its own transaction, naming the
database roles, the client address and host, the command line (no password) and the
counts; the same command without --yes writes none."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from composer_ops import Engine
from composer_ops.cli import main
from tests.integration.helpers import seed_aligned


def _rows(db_url: str) -> list[dict[str, Any]]:
    with psycopg.connect(db_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute("SELECT * FROM operator_audit ORDER BY id").fetchall()


def test_each_action_writes_one_row_and_its_dry_run_none(db_url: str, tmp_path: Path) -> None:
    with psycopg.connect(db_url) as conn:
        info = seed_aligned(conn)
        conn.commit()
    secret_url = make_conninfo(db_url, password="hunter2")     # the test servers ignore it (trust)
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy({"id": "audited", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        for _ in range(2):
            engine.start("audited", input={"audit": 1})
        failed = engine.start("audited", input={"audit": 2})
        for claim in engine.claim(["default"], "w", 10):
            if claim.run_id == failed:
                engine.fail(claim, "x", retryable=False)
    archive = str(tmp_path / "archive")
    steps: list[tuple[list[str], list[str], str, str]] = [
        # (dry run, real command, action, target)
        (["partitions", "archive", "--older-than", "2025-02-01", "--to", archive, "--dry-run"],
         ["partitions", "archive", "--older-than", "2025-02-01", "--to", archive], "partitions archive", "202412"),
        (["partitions", "drop", "--older-than", "2025-02-01", "--archive", archive],
         ["partitions", "drop", "--older-than", "2025-02-01", "--archive", archive, "--yes"], "partitions drop",
         "202412"),
        (["partitions", "restore", "202501", "--from", archive],
         ["partitions", "restore", "202501", "--from", archive, "--yes"], "partitions restore", "202501"),
        (["partitions", "detach", "--older-than", "2025-02-01"],
         ["partitions", "detach", "--older-than", "2025-02-01", "--yes"], "partitions detach", "202501"),
        (["runs", "cancel", "--where", "input.audit=1"],
         ["runs", "cancel", "--where", "input.audit=1", "--yes"], "runs cancel", "input@>{\"audit\":1}"),
        (["runs", "retry", failed], ["runs", "retry", failed, "--yes"], "runs retry", failed),
        (["runs", "delete", info.runs["H4"]], ["runs", "delete", info.runs["H4"], "--yes"], "runs delete",
         info.runs["H4"]),
    ]
    for dry, real, action, target in steps:
        before = len(_rows(db_url))
        assert main([*dry, "--database-url", secret_url]) in (0, 3), dry
        assert len(_rows(db_url)) == before, f"{dry}: a dry run wrote an audit row"
        assert main([*real, "--database-url", secret_url]) in (0, 3), real
        new = [r for r in _rows(db_url)[before:] if r["action"] == action and target in r["target"]]
        assert new, f"{real}: no {action} row for {target}"
        row = new[0]
        assert (row["login_role"], row["db_role"], row["client_addr"]) == ("postgres", "postgres", "local")
        assert row["client_host"] == socket.gethostname() and row["counts"]
        assert row["command"].startswith(f"composer-ops {' '.join(real[:2])}")
        assert "hunter2" not in row["command"] and "***" in row["command"]
    actions = [r["action"] for r in _rows(db_url)]
    assert actions.count("runs cancel") == 1 and actions.count("runs retry") == 1
    assert set(actions) == {a for _, _, a, _ in steps}


@pytest.mark.parametrize("action", ["runs delete"])
def test_an_action_that_changes_nothing_writes_no_row(db_url: str, action: str) -> None:
    with psycopg.connect(db_url) as conn:
        info = seed_aligned(conn)
        conn.commit()
    base = ["runs", "delete", info.runs["H1"], "--database-url", db_url, "--yes"]
    assert main(base) == 0 and main(base) == 0         # the second finds it deleted already
    assert [r["action"] for r in _rows(db_url)] == [action]


def test_audit_list_shows_one_line_per_command_and_the_report_keeps_older_commands(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bulk cancel of 120 runs in chunks of 2 writes 60 rows but is one command: one
    line in ``audit list``, one row of the report's newest 50, which still shows the
    archive command before it (one line for its three months)."""
    import json

    from composer_ops import ops

    with psycopg.connect(db_url) as conn:
        seed_aligned(conn)
        conn.commit()
    archive = ["partitions", "archive", "--older-than", "2025-05-01", "--to", str(tmp_path / "a"),
               "--database-url", db_url]
    assert main(archive) == 0
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy({"id": "bulk", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        for i in range(120):
            engine.start("bulk", input={"k": "bulk", "i": i})
    assert main(["runs", "cancel", "--where", "input.k=bulk", "--chunk", "2", "--yes", "--database-url", db_url]) == 0
    capsys.readouterr()
    assert len([r for r in _rows(db_url) if r["action"] == "runs cancel"]) == 60
    assert main(["audit", "list", "--database-url", db_url]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2, lines
    assert "runs cancel" in lines[0] and "cancelled 120" in lines[0] and "60 transaction(s)" in lines[0]
    assert "partitions archive" in lines[1] and "3 transaction(s)" in lines[1]
    assert main(["audit", "list", "--json", "--action", "partitions archive", "--database-url", db_url]) == 0
    [command] = json.loads(capsys.readouterr().out)
    assert command["actions"] == ["partitions archive"] and len(command["rows"]) == 3
    assert command["targets"] == ["202412", "202501", "202503"] and "T" in command["at"]
    assert main(["audit", "list", "--since", "1h", "--action", "runs cancel", "--database-url", db_url]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1
    newest = ops.audit_log(db_url, limit=50)
    assert newest["action"].to_list() == ["runs cancel", "partitions archive"]
    assert newest["transactions"].to_list() == [60, 3]


@pytest.mark.parametrize(("option", "value"), [("--since", "yesterday"), ("--action", "runs kill"),
                                               ("--limit", "0")])
def test_audit_list_refuses_bad_input_with_exit_2(db_url: str, capsys: pytest.CaptureFixture[str], option: str,
                                                  value: str) -> None:
    assert main(["audit", "list", option, value, "--database-url", db_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (option in err or value in err), err


def test_every_action_the_runbooks_take_is_listed_by_its_name(db_url: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The on-call actions (the runbooks' lease sweep and partitions ensure) are audit
    actions `audit list --action` takes; a row of any other name is a bug, refused."""
    from composer_ops.core.actor import Actor
    from composer_ops.engine import oncall
    from composer_ops.repo import audit

    who = Actor(command="runbook sweeper_lag", host="test")
    with Engine.connect(db_url, pool_size=1) as engine:
        oncall.sweep_leases(engine, actor=who)
        oncall.ensure_partitions(engine, 3, actor=who)
    for action in ("lease sweep", "partitions ensure"):
        assert main(["audit", "list", "--action", action, "--json", "--database-url", db_url]) == 0
        assert action in capsys.readouterr().out
    with psycopg.connect(db_url) as conn, pytest.raises(ValueError, match="'runs kill' is not one of ACTIONS"):
        audit.record(conn, "runs kill", actor=None, target=None, counts={})


def test_drop_with_archive_counts_each_months_rows_once(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``drop --archive`` writes an archive row and a drop row per month, each counting the
    month's rows: the command's counts are per action, not their sum (twice the rows)."""
    import json

    with psycopg.connect(db_url) as conn:
        seed_aligned(conn)
        conn.commit()
    assert main(["partitions", "drop", "--older-than", "2025-02-01", "--archive", str(tmp_path / "a"), "--yes",
                 "--database-url", db_url]) == 0
    capsys.readouterr()
    assert main(["audit", "list", "--database-url", db_url]) == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    assert "[partitions archive: rows 12; partitions drop: rows 12, " in line and "4 transaction(s)" in line, line
    assert main(["audit", "list", "--json", "--database-url", db_url]) == 0
    [command] = json.loads(capsys.readouterr().out)
    assert command["counts"]["partitions archive"]["rows"] == command["counts"]["partitions drop"]["rows"] == 12


@pytest.mark.parametrize("column,value", [
    ("at", "now() - interval '2 days'"),
    ("login_role", "'composer_owner'"),
    ("db_role", "'composer_owner'"),
    ("client_addr", "'10.0.0.1'"),
])
def test_the_engine_role_cannot_forge_who_or_when(db_url: str, column: str, value: str) -> None:
    """The engine role held INSERT on every column: a worker's login could write a row
    dated days back and signed by the owner. It may write the columns the commands fill
    in only; the database fills in when, who and from where."""
    from tests.notebooks.harness import as_role

    engine_url = as_role(db_url, "composer_ops_engine")
    with psycopg.connect(engine_url) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(f"INSERT INTO operator_audit (action, target, {column}) "
                     f"VALUES ('partitions drop', '202607', {value})")
    with psycopg.connect(engine_url) as conn:
        conn.execute("INSERT INTO operator_audit (action, target, command) VALUES ('runs cancel', 'x', 'c')")
        conn.commit()
    [row] = _rows(db_url)
    assert row["db_role"] == "composer_ops_engine" and row["login_role"] != "composer_owner"
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT now() - %s < interval '1 minute'", (row["at"],)).fetchone() == (True,)


def test_the_engine_role_still_writes_its_operator_actions_audit(db_url: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from tests.notebooks.harness import as_role

    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy({"id": "audited", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        engine.start("audited", input={})
    argv = ["runs", "cancel", "--workflow", "audited", "--yes",
            "--database-url", as_role(db_url, "composer_ops_engine")]
    assert main(argv) == 0, capsys.readouterr().err
    assert [(r["action"], r["db_role"]) for r in _rows(db_url)] == [("runs cancel", "composer_ops_engine")]
