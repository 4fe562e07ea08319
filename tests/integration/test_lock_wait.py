"""Operator commands on a run whose row lock another session holds: each waits at most
its bound (``--lock-wait``, COMPOSER_LOCK_WAIT), then gives up with one line naming the
run and the session holding it, exit 1, nothing changed; once the lock is released the
same command succeeds. A bulk cancel's dry run lists such a run apart, not decided."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main

#: The bound the commands get here; the assertions allow a loaded machine 20 s more.
WAIT_S = 1.0

SPEC = {"id": "lockwait", "nodes": [{"id": "wait", "type": "WAIT_FOR_SIGNAL", "signal": "go"}]}


@pytest.fixture
def engine(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    monkeypatch.setenv("COMPOSER_LOCK_WAIT", str(WAIT_S))
    with Engine.connect(db_url, pool_size=2) as e:
        e.deploy(SPEC)
        yield e


@contextmanager
def _held(db_url: str, run_id: str) -> Iterator[int]:
    """The run's row lock, held by another session (as an operator's psql would); its pid."""
    with psycopg.connect(db_url, application_name="psql-holder") as conn:
        conn.execute("SELECT id FROM workflow_runs WHERE id = %s FOR UPDATE", (run_id,))
        try:
            yield conn.info.backend_pid
        finally:
            conn.rollback()


def _state(db_url: str, run_id: str) -> tuple[Any, ...]:
    """What a command that gave up must not have changed: the run's status, its history
    rows and the audit rows."""
    with psycopg.connect(db_url) as conn:
        status = conn.execute("SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
        history = conn.execute("SELECT count(*) FROM run_history WHERE run_id = %s", (run_id,)).fetchone()
        audit = conn.execute("SELECT count(*) FROM operator_audit").fetchone()
    return status, history, audit


def _gives_up(db_url: str, run_id: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``argv`` behind the held lock: it gives up within the bound, exit 1, one line
    naming the run and the holder's pid, nothing changed. Its stdout."""
    before = _state(db_url, run_id)
    with _held(db_url, run_id) as pid:
        started = time.monotonic()
        code = main([*argv, "--database-url", db_url])
        took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 1, (code, out, err)
    assert took < WAIT_S + 20, took
    assert err.count("\n") == 1 and run_id in err and f"pid {pid}" in err and "psql-holder" in err, err
    assert _state(db_url, run_id) == before
    return out


def _status(db_url: str, run_id: str) -> str:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.timeout(60)
def test_cancel_gives_up_behind_a_held_row_lock(db_url: str, engine: Engine,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = engine.start("lockwait")
    _gives_up(db_url, run, ["cancel", run], capsys)
    assert main(["cancel", run, "--database-url", db_url]) == 0
    assert _status(db_url, run) == "CANCELLED"


@pytest.mark.timeout(60)
def test_signal_gives_up_behind_a_held_row_lock(db_url: str, engine: Engine,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = engine.start("lockwait")
    _gives_up(db_url, run, ["signal", run, "go"], capsys)
    assert main(["signal", run, "go", "--database-url", db_url]) == 0
    assert _status(db_url, run) == "SUCCEEDED"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("yes", [False, True], ids=["dry-run", "yes"])
def test_retry_gives_up_behind_a_held_row_lock(db_url: str, engine: Engine, yes: bool,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = engine.start("lockwait")
    engine.cancel(run)
    argv = ["runs", "retry", run, *(["--yes"] if yes else [])]
    _gives_up(db_url, run, argv, capsys)
    assert main([*argv, "--database-url", db_url]) == 0
    assert _status(db_url, run) == ("RUNNING" if yes else "CANCELLED")


@pytest.mark.timeout(60)
def test_bulk_cancel_gives_up_behind_a_held_row_lock(db_url: str, engine: Engine,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = engine.start("lockwait", input={"customer": 77})
    argv = ["runs", "cancel", "--where", "input.customer=77", "--yes"]
    _gives_up(db_url, run, argv, capsys)
    assert main([*argv, "--database-url", db_url]) == 0
    assert _status(db_url, run) == "CANCELLED"


@pytest.mark.timeout(60)
def test_bulk_cancel_dry_run_lists_a_locked_run_as_not_decided(db_url: str, engine: Engine,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    runs = sorted(engine.start("lockwait", input={"customer": 78}) for _ in range(2))
    locked, free = runs
    argv = ["runs", "cancel", "--where", "input.customer=78", "--database-url", db_url]
    before = _state(db_url, locked)
    with _held(db_url, locked):
        started = time.monotonic()
        code = main(argv)
        took = time.monotonic() - started
    out = capsys.readouterr().out
    assert code == 0 and took < WAIT_S + 20, (code, took, out)
    assert f"would cancel {free}" in out and f"would cancel {locked}" not in out, out
    assert f"{locked}: locked by another session: not decided" in out, out
    assert _state(db_url, locked) == before
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"would cancel {locked}" in out and "not decided" not in out, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("yes", [False, True], ids=["dry-run", "yes"])
def test_bulk_retry_refuses_a_locked_run_and_goes_on(db_url: str, engine: Engine, yes: bool,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the first locked run ended the whole bulk retry with its error."""
    runs = []
    for _ in range(2):
        run = engine.start("lockwait", input={"customer": 79})
        engine.cancel(run)
        runs.append(run)
        time.sleep(0.005)                       # distinct milliseconds: ID order is start order
    locked, free = runs
    argv = ["runs", "retry", "--where", "input.customer=79", "--status", "CANCELLED", "--json",
            *(["--yes"] if yes else []), "--database-url", db_url]
    before = _state(db_url, locked)
    with _held(db_url, locked) as pid:
        started = time.monotonic()
        code = main(argv)
        took = time.monotonic() - started
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and took < WAIT_S + 20, (code, took, out)     # a refused run is listed, as others are
    assert [r["run_id"] for r in out["retried"]] == [free], out
    ((refused, why),) = [(r["run_id"], r["error"]) for r in out["refused"]]
    assert refused == locked and f"pid {pid}" in why and "its lock was not granted" in why, why
    assert _state(db_url, locked)[0] == before[0] == ("CANCELLED",)
    assert _status(db_url, free) == ("RUNNING" if yes else "CANCELLED")


@pytest.mark.timeout(60)
def test_delete_gives_up_behind_a_held_row_lock(db_url: str, engine: Engine,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = engine.start("lockwait")
    engine.cancel(run)
    argv = ["runs", "delete", run, "--yes"]
    _gives_up(db_url, run, argv, capsys)
    assert main([*argv, "--database-url", db_url]) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["EXCLUSIVE", "ACCESS EXCLUSIVE"])
def test_behind_a_table_lock_the_likely_holders_are_named(db_url: str, engine: Engine, mode: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A lock on the whole table, not the run's row (ACCESS EXCLUSIVE: not even its row
    can be read): its holder is named as likely."""
    run = engine.start("lockwait")
    with psycopg.connect(db_url, application_name="psql-table") as conn:
        conn.execute(f"LOCK TABLE workflow_runs IN {mode} MODE")
        pid = conn.info.backend_pid
        started = time.monotonic()
        code = main(["cancel", run, "--database-url", db_url])
        took = time.monotonic() - started
        conn.rollback()
    err = capsys.readouterr().err
    assert code == 1 and took < WAIT_S + 20, (code, took, err)
    assert f"likely held by one of: pid {pid} (" in err and "psql-table" in err and run in err, err
    assert _status(db_url, run) == "RUNNING"
