"""The error boundary on a real server: every error a composer_ops connection or pool
raises, wherever it is raised (a statement, the COMMIT at the end of a transaction
block, waiting for a pooled connection, connecting, a session the server ended), is a
ComposerError with the driver's error as ``__cause__``; ``db_retry`` re-runs exactly
the transient ones."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import errors as pgerr
from psycopg_pool import PoolTimeout

from composer_ops import ops
from composer_ops.cli import main
from composer_ops.db import connect, make_pool
from composer_ops.db.errors import TranslatingClientCursor, TranslatingCursor, TranslatingServerCursor
from composer_ops.db.retry import db_retry
from composer_ops.errors import ComposerError, Conflict, Invalid, LockTimeout, Transient, Unavailable

NOWHERE = "postgresql:///composer?host=/nonexistent-socket-dir&connect_timeout=2"


@pytest.fixture
def table(db_url: str) -> str:
    """A table whose unique key is checked at COMMIT, and one row to fight over."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE boundary (k int, v int, "
                     "CONSTRAINT boundary_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)")
        conn.execute("INSERT INTO boundary VALUES (1, 0), (2, 0)")
    return db_url


def test_a_statement_error_is_a_composer_error_caused_by_the_driver_error(db_url: str) -> None:
    with connect(db_url) as conn:
        with pytest.raises(Invalid, match="division by zero") as caught:
            conn.execute("SELECT 1 / 0")
    assert isinstance(caught.value.__cause__, pgerr.DivisionByZero)


def test_an_error_raised_by_the_commit_of_a_transaction_block_is_translated(table: str) -> None:
    """Nothing is wrong until COMMIT: the error comes out of ``conn.transaction()``'s
    exit, not out of an execute."""
    with make_pool(table, min_size=1, max_size=1) as pool:
        with pytest.raises(Conflict, match="boundary_k") as caught:
            with pool.connection() as conn, conn.transaction():
                conn.execute("INSERT INTO boundary VALUES (1, 1)")       # accepted until COMMIT
        assert isinstance(caught.value.__cause__, pgerr.UniqueViolation)
        with pool.connection() as conn:                                   # the pool's connection still works
            assert conn.execute("SELECT count(*) FROM boundary").fetchone() == (2,)


def test_a_pool_timeout_is_transient_and_retried(db_url: str) -> None:
    calls: list[int] = []
    with make_pool(db_url, min_size=1, max_size=1) as pool:
        pool.timeout = 0.05             # once open: opening on a loaded machine may take longer

        @db_retry(max_attempts=3, base=0.001, cap=0.001)
        def txn() -> None:
            calls.append(1)
            with pool.connection():
                pass

        with pool.connection():                                          # the only connection is taken
            with pytest.raises(Transient, match="can be retried") as caught:
                txn()
    assert isinstance(caught.value.__cause__, PoolTimeout) and len(calls) == 3


def test_a_session_the_server_ended_is_transient_and_the_retry_runs_on_a_new_one(table: str) -> None:
    calls: list[int] = []
    with make_pool(table, min_size=1, max_size=1) as pool:

        @db_retry(max_attempts=3, base=0.001, cap=0.001)
        def txn() -> int:
            calls.append(1)
            with pool.connection() as conn, conn.transaction():
                if len(calls) == 1:
                    with psycopg.connect(table, autocommit=True) as killer:
                        killer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
                row = conn.execute("UPDATE boundary SET v = v + 1 WHERE k = 1 RETURNING v").fetchone()
                assert row is not None
                return int(row[0])

        assert txn() == 1 and len(calls) == 2


@pytest.mark.parametrize("end", ["session ended", "session ended unseen", "transaction aborted"])
def test_a_server_cursor_whose_close_fails_is_closed_all_the_same(table: str, end: str) -> None:
    """Closing a named cursor can fail (its session ended, its transaction aborted by
    another statement): the error is translated, and the cursor is closed all the same,
    so collecting it warns of nothing (filterwarnings = error made such a warning fail
    the fault sweep's drop --archive)."""
    with connect(table) as conn:
        cur = conn.cursor(name="boundary_stream")
        cur.execute("SELECT k FROM boundary ORDER BY k")
        assert cur.fetchmany(1) == [(1,)]
        if end.startswith("session ended"):
            with psycopg.connect(table, autocommit=True) as killer:
                killer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        else:
            with pytest.raises(Invalid):
                conn.execute("SELECT 1 / 0")
        if end != "session ended unseen":       # else the close is the first to find the session gone
            with contextlib.suppress(ComposerError):
                cur.fetchmany(1)
        with contextlib.suppress(ComposerError):
            cur.close()
        assert cur.closed


def _two_sessions(url: str, first: str, second: str) -> BaseException | None:
    """Run ``first`` then ``second`` in two overlapping transactions on connections of
    the boundary; return what the loser raised (None if neither failed)."""
    failures: list[BaseException] = []
    with connect(url) as a, connect(url) as b:
        a.execute("UPDATE boundary SET v = v + 1 WHERE k = 1")
        b.execute("UPDATE boundary SET v = v + 1 WHERE k = 2")

        def run(conn: psycopg.Connection[Any], statement: str) -> None:
            try:
                conn.execute(statement)
                conn.commit()
            except BaseException as exc:   # noqa: BLE001 - handed to the test
                failures.append(exc)
                conn.rollback()

        racers = [threading.Thread(target=run, args=(a, first)), threading.Thread(target=run, args=(b, second))]
        for t in racers:
            t.start()
        for t in racers:
            t.join(30)
    return failures[0] if failures else None


def test_a_deadlock_is_transient(table: str) -> None:
    loser = _two_sessions(table, "UPDATE boundary SET v = v + 1 WHERE k = 2",
                          "UPDATE boundary SET v = v + 1 WHERE k = 1")
    assert isinstance(loser, Transient) and isinstance(loser.__cause__, pgerr.DeadlockDetected)


def test_a_lock_timeout_is_transient(table: str) -> None:
    with connect(table) as holder, connect(table) as waiter:
        holder.execute("UPDATE boundary SET v = v + 1 WHERE k = 1")
        waiter.execute("SET lock_timeout = '50ms'")
        with pytest.raises(LockTimeout) as caught:
            waiter.execute("UPDATE boundary SET v = v + 1 WHERE k = 1")
    assert isinstance(caught.value, Transient) and isinstance(caught.value.__cause__, pgerr.LockNotAvailable)


def test_a_serialization_failure_is_transient(table: str) -> None:
    with connect(table) as a, connect(table) as b:
        for conn in (a, b):
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.execute("SELECT v FROM boundary WHERE k = 1")
        a.execute("UPDATE boundary SET v = v + 1 WHERE k = 1")
        a.commit()
        with pytest.raises(Transient) as caught:
            b.execute("UPDATE boundary SET v = v + 1 WHERE k = 1")
    assert isinstance(caught.value.__cause__, pgerr.SerializationFailure)


@pytest.mark.parametrize("message, transient", [
    ("failure on connection marked as essential: 127.0.0.1:40112", True),
    ("SSL SYSCALL error: EOF detected", True),
    ("server closed the connection unexpectedly", True),
    ("could not find the shard placement", False),
])
def test_a_citus_worker_node_lost_mid_statement_is_transient(db_url: str, message: str, transient: bool) -> None:
    """Citus raises these as internal errors (XX000) on the coordinator; raised here
    the same way by the server, with the same SQLSTATE and text."""
    with connect(db_url) as conn:
        with pytest.raises(ComposerError) as caught:
            conn.execute(f"DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'XX000', MESSAGE = '{message}'; END $$")
    assert isinstance(caught.value.__cause__, pgerr.InternalError_)
    assert isinstance(caught.value, Transient) is transient, caught.value


def test_a_statement_timeout_is_not_transient(db_url: str) -> None:
    with connect(db_url) as conn:
        conn.execute("SET statement_timeout = '20ms'")
        with pytest.raises(Unavailable) as caught:
            conn.execute("SELECT pg_sleep(1)")
    assert not isinstance(caught.value, Transient) and isinstance(caught.value.__cause__, pgerr.QueryCanceled)


def test_connect_failures_are_unavailable_and_transient_only_when_waiting_may_help(db_url: str) -> None:
    with pytest.raises(Transient, match=r"^cannot connect to the database: ") as down:
        connect(NOWHERE)
    assert isinstance(down.value.__cause__, psycopg.OperationalError)
    bad_role = psycopg.conninfo.make_conninfo(db_url, user="no_such_role_at_all")
    with pytest.raises(Unavailable, match="no_such_role_at_all") as refused:
        connect(bad_role)
    assert not isinstance(refused.value, Transient)


def test_ops_functions_raise_the_same_one_line_errors(db_url: str) -> None:
    """What a notebook shows: a ComposerError of one line, not a driver traceback."""
    with pytest.raises(Unavailable) as caught:
        ops.active_by_group(NOWHERE)
    assert "\n" not in str(caught.value)


def test_the_cli_prints_a_server_refusal_as_one_line(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["partitions", "ensure", "--database-url", db_url, "--months-ahead", "100000"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("composer-ops: invalid: ")
    assert "between 0 and 120" in err


def test_every_error_above_the_boundary_is_a_composer_error(db_url: str) -> None:
    """A statement the server refuses for each reason class, through a pooled
    connection: none escapes as a driver error."""
    statements = ["SELECT * FROM no_such_table", "SELEC 1", "SELECT 'x'::int", "SELECT composer_ensure_partitions(-1)"]
    with make_pool(db_url, min_size=1, max_size=1) as pool:
        for statement in statements:
            with pytest.raises(ComposerError) as caught, pool.connection() as conn:
                conn.execute(statement.encode())
            assert isinstance(caught.value.__cause__, psycopg.Error), statement


# -- every path a driver error can take -------------------------------------------------

def _execute(c: Any) -> None:
    c.execute("SELECT 1 / 0")


def _executemany(c: Any) -> None:
    c.cursor().executemany("INSERT INTO boundary VALUES (%s, %s)", [(3, 0), (1.5, 0), ("x", 0)])


def _copy_in(c: Any) -> None:
    with c.cursor().copy("COPY boundary (k, v) FROM STDIN") as copy:
        copy.write(b"not a number\t0\n")


def _copy_out(c: Any) -> None:
    with c.cursor().copy("COPY (SELECT 1 / (k - 1) FROM boundary) TO STDOUT") as copy:
        for _ in copy:
            pass


def _pipeline_sync(c: Any) -> None:
    with c.pipeline():
        c.execute("SELECT 1")
        c.execute("SELECT 1 / 0")


def _commit(c: Any) -> None:
    c.execute("INSERT INTO boundary VALUES (1, 1)")   # the deferred unique key is checked at COMMIT
    c.commit()


def _transaction_exit(c: Any) -> None:
    with c.transaction():
        c.execute("INSERT INTO boundary VALUES (1, 1)")


def _server_cursor_fetch(c: Any) -> None:
    with c.cursor(name="boundary_cursor") as cur:
        cur.execute("SELECT 1 / (k - 1) FROM boundary ORDER BY k DESC")
        cur.fetchall()


def _server_cursor_iteration(c: Any) -> None:
    with c.cursor(name="boundary_iter") as cur:
        cur.itersize = 2                                       # the second FETCH reaches g = 3
        cur.execute("SELECT 1 / (g - 3) FROM generate_series(1, 5) g")
        for _ in cur:
            pass


def _fetch_in_a_pipeline(c: Any) -> None:
    with c.pipeline():
        cur = c.execute("SELECT 1 / 0")
        cur.fetchone()                                         # fetching syncs the pipeline


def _nested_transaction(c: Any) -> None:
    with c.transaction(), c.transaction():                     # the inner one is a savepoint
        c.execute("INSERT INTO boundary VALUES (1, 1)")
        c.execute("SET CONSTRAINTS boundary_k IMMEDIATE")


def _read_only_in_a_transaction(c: Any) -> None:
    c.execute("SELECT 1")
    c.read_only = True


def _client_cursor(c: Any) -> None:
    c.cursor_factory = TranslatingClientCursor
    c.cursor().execute("SELECT 1 / %s", (0,))


def _stream(c: Any) -> None:
    for _ in c.cursor().stream("SELECT 1 / (g - 3) FROM generate_series(1, 5) g"):
        pass


def _autocommit_in_a_transaction(c: Any) -> None:
    c.execute("SELECT 1")
    c.autocommit = True


def _notifies_of_a_session_the_server_ended(c: Any) -> None:
    c.autocommit = True
    c.execute("LISTEN boundary")
    with psycopg.connect(c.info.dsn, autocommit=True) as killer:
        killer.execute("SELECT pg_terminate_backend(%s, 5000)", (c.info.backend_pid,))   # returns once it exited
    for _ in c.notifies(timeout=30):
        pass


def _cancelled_statement(c: Any) -> None:
    pid, dsn = c.info.backend_pid, c.info.dsn

    def cancel_once_running() -> None:
        with psycopg.connect(dsn, autocommit=True) as watcher:
            for _ in range(600):
                row = watcher.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
                if row == ("active",):
                    c.cancel()
                    return
                time.sleep(0.05)

    threading.Thread(target=cancel_once_running, daemon=True).start()
    c.execute("SELECT pg_sleep(30)")


PATHS = [_execute, _executemany, _copy_in, _copy_out, _pipeline_sync, _commit, _transaction_exit,
         _server_cursor_fetch, _server_cursor_iteration, _fetch_in_a_pipeline, _nested_transaction,
         _read_only_in_a_transaction, _client_cursor, _stream, _autocommit_in_a_transaction,
         _notifies_of_a_session_the_server_ended, _cancelled_statement]


@pytest.mark.parametrize("path", PATHS, ids=lambda f: f.__name__.strip("_"))
def test_a_driver_error_on_every_path_arrives_as_a_composer_error(table: str, path: Any) -> None:
    with connect(table) as conn:
        with pytest.raises(ComposerError) as caught:
            path(conn)
    assert isinstance(caught.value.__cause__, psycopg.Error), path
    assert "\n" not in str(caught.value)


def test_a_misuse_psycopg_finds_reading_rows_is_left_as_a_bug(db_url: str) -> None:
    """No round trip, nothing the database did: fetching from a statement with no rows."""
    with connect(db_url) as conn:
        cur = conn.execute("SET search_path = public")
        with pytest.raises(psycopg.ProgrammingError) as caught:
            cur.fetchone()
        assert not isinstance(caught.value, ComposerError)


def test_a_connection_opens_cursors_of_the_boundary(db_url: str) -> None:
    with connect(db_url) as conn, conn.cursor() as cur, conn.cursor(name="c") as named:
        assert type(cur) is TranslatingCursor and type(named) is TranslatingServerCursor
        assert type(conn.execute("SELECT 1")) is TranslatingCursor


def test_an_idle_listen_returns_at_its_timeout(db_url: str) -> None:
    """psycopg's internal wait timeout passes through the boundary untranslated, so
    ``notifies(timeout=...)`` returns instead of raising."""
    with connect(db_url, autocommit=True) as conn:
        conn.execute("LISTEN boundary_idle")
        assert list(conn.notifies(timeout=0.1)) == []


def test_a_connection_closed_here_is_an_error_no_retry_can_cure(db_url: str) -> None:
    calls: list[int] = []
    conn = connect(db_url)
    conn.close()

    @db_retry(max_attempts=3, base=0.001, cap=0.001)
    def txn() -> None:
        calls.append(1)
        conn.execute("SELECT 1")

    with pytest.raises(ComposerError, match="closed by this process") as caught:
        txn()
    assert not isinstance(caught.value, Transient) and len(calls) == 1


def test_a_pooled_connection_the_server_ended_is_replaced_quietly(db_url: str) -> None:
    with make_pool(db_url, min_size=1, max_size=1) as pool:
        with pool.connection() as conn:
            pid = conn.info.backend_pid
        with psycopg.connect(db_url, autocommit=True) as killer:
            killer.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))   # returns once it has exited
        with pool.connection() as conn:                    # the pool's check drops the dead one
            assert conn.execute("SELECT pg_backend_pid()").fetchone() != (pid,)
