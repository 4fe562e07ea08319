"""Operator commands on a run whose row lock another session holds: each waits at most
its bound (``--lock-wait``, COMPOSER_LOCK_WAIT), then gives up with one line naming the
run and the session holding it, exit 1, nothing changed; once the lock is released the
same command succeeds. A bulk cancel's dry run lists such a run apart, not decided."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.errors import LockTimeout

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


def test_a_lock_wait_past_the_servers_largest_is_its_largest(db_url: str, engine: Engine,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`--lock-wait 3000000` failed on the server's `invalid value for parameter
    "lock_timeout"`, a line that never named the option; the wait is the server's largest."""
    run = engine.start("lockwait")
    assert main(["cancel", run, "--lock-wait", "3000000", "--database-url", db_url]) == 0, capsys.readouterr()
    assert _status(db_url, run) == "CANCELLED"


SPEC2 = {"id": "two", "nodes": [{"id": "w1", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
                                 {"id": "w2", "type": "WAIT_FOR_SIGNAL", "signal": "go"}]}


def _hold_for(db_url: str, run_id: str, seconds: float, ready: threading.Event) -> None:
    with psycopg.connect(db_url, application_name="slow-holder") as conn:
        conn.execute("SELECT id FROM workflow_runs WHERE id = %s FOR UPDATE", (run_id,))
        ready.set()
        time.sleep(seconds)
        conn.rollback()


@pytest.mark.timeout(60)
def test_a_retry_that_gives_up_after_a_lost_ack_does_not_say_nothing_changed(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first attempt commits, its acknowledgement is lost (the backend dies after the
    COMMIT), and before the retry another session holds the run's lock past the wait.
    Before, the retry said "nothing was changed" though the signal was applied, and
    doing as told sent it twice (an adversarial review's finding)."""
    with Engine.connect(db_url, pool_size=2, lock_wait_s=WAIT_S) as engine:
        engine.deploy(SPEC2)
        run = engine.start("two")
        real = engine.pool.connection
        holder: list[threading.Thread] = []

        @contextmanager
        def lose_ack_then_hold(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with real(*args, **kwargs) as conn:
                yield conn
                if not holder:
                    ready = threading.Event()
                    holder.append(threading.Thread(target=_hold_for, args=(db_url, run, WAIT_S + 3, ready)))
                    holder[0].start()
                    ready.wait(10)
                    conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        monkeypatch.setattr(engine.pool, "connection", lose_ack_then_hold)
        with pytest.raises(LockTimeout) as caught:
            engine.signal(run, "go", {"n": 1})
        monkeypatch.undo()
        holder[0].join()
        said = str(caught.value)
        assert "nothing was changed" not in said, said
        assert "an earlier attempt of this call may have been applied" in said and "slow-holder" in said, said
        assert [t.state for t in engine.get_run(run).tasks] == ["COMPLETED", "WAITING"]     # it was


@pytest.mark.timeout(90)
def test_a_bulk_cancel_that_gives_up_says_what_it_kept(db_url: str, engine: Engine,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Chunks committed before the locked run stay cancelled: the line says so and --json
    lists them (before: "nothing was changed" and no JSON at all)."""
    runs = []
    for _ in range(3):
        runs.append(engine.start("lockwait", input={"customer": 5}))
        time.sleep(0.005)
    with _held(db_url, runs[-1]) as pid:
        code = main(["runs", "cancel", "--where", "input.customer=5", "--yes", "--chunk", "1", "--json",
                     "--database-url", db_url])
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    assert err.count("\n") == 1 and f"pid {pid}" in err and "nothing was changed" not in err, err
    assert "this step was rolled back, the 2 run(s) cancelled before it stay cancelled" in err, err
    done = json.loads(out)
    assert (done["applied"], done["interrupted"], done["cancelled"]) == (True, True, runs[:2]), done
    assert [_status(db_url, r) for r in runs] == ["CANCELLED", "CANCELLED", "RUNNING"]


@pytest.mark.timeout(60)
def test_a_holder_that_locked_in_a_savepoint_is_named_not_the_readers(db_url: str, engine: Engine) -> None:
    """A row locked inside a savepoint (as the bulk cancel and psql's ON_ERROR_ROLLBACK
    do) has the subtransaction's ID as its xmax: before, the holder was missed and three
    plain readers of the table were named instead."""
    run = engine.start("lockwait")
    readers = []
    try:
        for i in range(3):
            reader = psycopg.connect(db_url, application_name=f"reader-{i}")
            reader.execute("SELECT count(*) FROM workflow_runs")
            readers.append(reader)
        with psycopg.connect(db_url, application_name="real-holder") as holder:
            holder.execute("SAVEPOINT s")
            holder.execute("SELECT id FROM workflow_runs WHERE id = %s FOR UPDATE", (run,))
            pid = holder.info.backend_pid
            with pytest.raises(LockTimeout) as caught:
                engine.cancel(run)
            holder.rollback()
    finally:
        for reader in readers:
            reader.close()
    said = str(caught.value)
    assert f"held by pid {pid} (" in said and "real-holder" in said, said
    assert "reader-" not in said, said
