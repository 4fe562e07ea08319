"""The fault proxy itself: it forwards faithfully, counts requests the way the
fault suite relies on, and each fault lands exactly where it says."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from composer_ops.testing import servers
from composer_ops.testing.faultproxy import Fault, FaultProxy


@pytest.fixture
def proxy(db_url: str) -> Iterator[FaultProxy]:
    server = servers.session().primary
    with FaultProxy(db_url, restart=server.restart if server.owned else None) as p:
        yield p


@pytest.fixture
def table(db_url: str) -> str:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE proxied (id int PRIMARY KEY, note text)")
    return "proxied"


def _ids(db_url: str) -> list[int]:
    with psycopg.connect(db_url) as conn:
        return [r[0] for r in conn.execute("SELECT id FROM proxied ORDER BY id")]


def _insert_in_transaction(url: str, value: int) -> None:
    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute("INSERT INTO proxied VALUES (%s, 'x')", (value,))


def test_it_forwards_transactions_pipelines_copy_and_notifications(proxy: FaultProxy, table: str,
                                                                   db_url: str) -> None:
    with psycopg.connect(proxy.url()) as conn:
        proxy.reset()
        with conn.transaction():
            conn.execute("INSERT INTO proxied VALUES (1, 'a')")
        with conn.pipeline():
            conn.execute("INSERT INTO proxied VALUES (2, 'b')")
            conn.execute("INSERT INTO proxied VALUES (3, 'c')")
        conn.commit()
        with conn.cursor() as cur, cur.copy("COPY proxied FROM STDIN") as copy:
            copy.write_row((4, "d"))
        conn.commit()
        got: list[Any] = [r[0] for r in conn.execute("SELECT note FROM proxied ORDER BY id")]
        conn.rollback()
        listener = psycopg.connect(proxy.url(), autocommit=True)
        listener.execute("LISTEN chan")
        conn.execute("NOTIFY chan, 'hello'")
        conn.commit()
        heard = [n.payload for n in listener.notifies(timeout=60, stop_after=1)]
        listener.close()
    assert got == ["a", "b", "c", "d"] and heard == ["hello"]
    assert _ids(db_url) == [1, 2, 3, 4]
    texts = [r.text for r in proxy.requests]
    assert texts[:3] == ["BEGIN", "INSERT INTO proxied VALUES (1, 'a')", "COMMIT"]
    assert proxy.requests[2].commits and proxy.requests[2].tags == ["COMMIT"]
    assert not proxy.requests[1].commits and proxy.requests[1].status_after == "T"


def _pipelined_transaction(conn: psycopg.Connection[Any], value: int) -> None:
    """BEGIN, an INSERT and COMMIT in one pipeline on an autocommit connection (how
    the engine's one-statement events are sent): psycopg ends it with a Sync, then
    sends a Flush of its own."""
    with conn.pipeline():
        conn.execute("BEGIN")
        conn.execute("INSERT INTO proxied VALUES (%s, 'x')", (value,))
        conn.execute("COMMIT")


def test_a_pipelined_transaction_is_one_request_and_the_flush_after_it_none(proxy: FaultProxy, table: str,
                                                                             db_url: str) -> None:
    """A Flush that follows a pipeline's Sync opened a request of its own, which then
    swallowed the client's next request: the fault sweep numbered a pipelined event's
    requests wrongly, cut it after its COMMIT where it meant before, and saw none at
    all when psycopg happened not to send the Flush."""
    with psycopg.connect(proxy.url(), autocommit=True) as conn:
        proxy.reset()
        _pipelined_transaction(conn, 1)
        conn.execute("SELECT 1")
        _pipelined_transaction(conn, 2)
    assert [r.sql for r in proxy.requests] == [
        ["BEGIN", "INSERT INTO proxied VALUES ($1, 'x')", "COMMIT"], ["SELECT 1"],
        ["BEGIN", "INSERT INTO proxied VALUES ($1, 'x')", "COMMIT"]], proxy.describe()
    assert proxy.requests[0].commits and proxy.requests[2].commits
    assert proxy.requests[0].tags == ["BEGIN", "INSERT 0 1", "COMMIT"]
    assert "open=None" in proxy.describe()
    with psycopg.connect(proxy.url(), autocommit=True) as conn:
        proxy.reset()
        conn.execute("SELECT 1")
        proxy.arm(Fault.DROP_BEFORE, at=2)        # the pipeline: none of it reaches the server
        with pytest.raises(psycopg.OperationalError):
            _pipelined_transaction(conn, 3)
    assert proxy.fired is not None and proxy.fired.index == 2
    assert _ids(db_url) == [1, 2]


def test_drop_before_commit_rolls_back(proxy: FaultProxy, table: str, db_url: str) -> None:
    proxy.arm(Fault.DROP_BEFORE, match=lambda r: r.text == "COMMIT")
    with pytest.raises(psycopg.OperationalError):
        _insert_in_transaction(proxy.url(), 1)
    assert proxy.fired is not None and proxy.fired.text == "COMMIT"
    assert _ids(db_url) == []
    _insert_in_transaction(proxy.url(), 2)        # disarmed after firing: a healthy path again
    assert _ids(db_url) == [2]


def test_a_lost_acknowledgement_commits_but_the_client_never_hears(proxy: FaultProxy, table: str,
                                                                  db_url: str) -> None:
    proxy.arm(Fault.LOSE_ACK, match=lambda r: r.text == "COMMIT")
    with pytest.raises(psycopg.OperationalError):
        _insert_in_transaction(proxy.url(), 1)
    fired = proxy.fired
    assert fired is not None and fired.tags == ["COMMIT"] and fired.commits
    assert _ids(db_url) == [1]


def test_a_lost_acknowledgement_of_an_autocommit_statement(proxy: FaultProxy, table: str, db_url: str) -> None:
    with psycopg.connect(proxy.url(), autocommit=True) as conn:
        proxy.reset()
        proxy.arm(Fault.LOSE_ACK, at=1)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("INSERT INTO proxied VALUES (%s, 'x')", (7,))
    assert proxy.fired is not None and proxy.fired.commits and proxy.fired.tags == ["INSERT 0 1"]
    assert _ids(db_url) == [7]


def test_every_request_of_a_transaction_can_be_cut(proxy: FaultProxy, table: str, db_url: str) -> None:
    """Cut at request k for every k: before the COMMIT nothing is kept, after it
    (the lost acknowledgement) the row is there; the count stops when k passes the end."""
    kept: dict[tuple[str, int], bool] = {}
    for fault in (Fault.DROP_BEFORE, Fault.LOSE_ACK):
        k = 0
        while True:
            k += 1
            value = 100 * (fault is Fault.LOSE_ACK) + k
            with psycopg.connect(proxy.url()) as conn:
                proxy.reset()
                proxy.arm(fault, at=k)
                try:
                    with conn.transaction():
                        conn.execute("INSERT INTO proxied VALUES (%s, 'x')", (value,))
                        conn.execute("UPDATE proxied SET note = 'y' WHERE id = %s", (value,))
                except psycopg.OperationalError:
                    pass
            if proxy.fired is None:
                break
            kept[(fault.value, k)] = value in _ids(db_url)
    assert kept == {("drop-before", 1): False, ("drop-before", 2): False, ("drop-before", 3): False,
                    ("drop-before", 4): False, ("lose-ack", 1): False, ("lose-ack", 2): False,
                    ("lose-ack", 3): False, ("lose-ack", 4): True}


@pytest.mark.skipif("COMPOSER_DATABASE_URL" in os.environ, reason="the server is not ours to restart")
def test_a_restart_after_the_commit_keeps_it_and_kills_every_session(proxy: FaultProxy, table: str,
                                                                    db_url: str) -> None:
    bystander = psycopg.connect(proxy.url(), autocommit=True)
    bystander.execute("SELECT 1")
    proxy.arm(Fault.RESTART_AFTER, match=lambda r: r.text == "COMMIT")
    with pytest.raises(psycopg.OperationalError):
        _insert_in_transaction(proxy.url(), 1)
    assert proxy.wait_fired() is not None and proxy.restarts == 1
    with pytest.raises(psycopg.OperationalError):
        bystander.execute("SELECT 1")
    bystander.close()
    assert _ids(db_url) == [1]
    _insert_in_transaction(proxy.url(), 2)
    assert _ids(db_url) == [1, 2]


# -- the first attempt still committing when its retry starts ------------------------------


@pytest.fixture
def holding(db_url: str) -> Iterator[FaultProxy]:
    """A proxy that releases a held request only when something makes it (never on its
    own within a test)."""
    with FaultProxy(db_url, hold_max_s=120) as p:
        yield p


def _notes(db_url: str) -> dict[int, str]:
    with psycopg.connect(db_url) as conn:
        return {r[0]: r[1] for r in conn.execute("SELECT id, note FROM proxied ORDER BY id")}


def test_a_held_commit_keeps_its_locks_until_the_retry_waits_for_them(holding: FaultProxy, table: str,
                                                                     db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO proxied VALUES (1, 'before')")
    holding.arm(Fault.HOLD_COMMIT, match=lambda r: r.text == "COMMIT")
    with pytest.raises(psycopg.OperationalError), psycopg.connect(holding.url()) as first, first.transaction():
        first.execute("UPDATE proxied SET note = 'first' WHERE id = 1")
    fired = holding.fired
    assert fired is not None and fired.fault is Fault.HOLD_COMMIT and fired.tags == []
    assert _notes(db_url) == {1: "before"}            # not committed: the server never got the COMMIT
    with psycopg.connect(db_url, autocommit=True) as conn:
        held = conn.execute("SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                            "WHERE c.relname = 'proxied' AND l.mode = 'RowExclusiveLock' AND l.granted").fetchone()
    assert held == (1,)                               # the first attempt's transaction still holds its lock
    # the retry waits for the row lock (in a pipeline, as the engine's lock_and_load sends
    # it); the proxy sees it wait and lets the COMMIT through
    with psycopg.connect(holding.url()) as retry:
        with retry.pipeline():
            retry.execute("SELECT 1")
            locked = retry.execute("SELECT note FROM proxied WHERE id = 1 FOR UPDATE")
        seen = locked.fetchone()
        retry.commit()
    assert holding.wait_released()
    assert seen == ("first",) and fired.tags == ["COMMIT"] and fired.commits
    assert _notes(db_url) == {1: "first"}


def test_a_retry_that_commits_without_waiting_lets_the_held_commit_land_first(holding: FaultProxy, table: str,
                                                                              db_url: str) -> None:
    holding.arm(Fault.HOLD_COMMIT, match=lambda r: r.text == "COMMIT")
    with pytest.raises(psycopg.OperationalError):
        _insert_in_transaction(holding.url(), 1)
    assert _notes(db_url) == {}
    with psycopg.connect(holding.url(), autocommit=True) as retry:
        # an autocommit statement commits: it waits until the held COMMIT is answered
        retry.execute("INSERT INTO proxied SELECT 2, (SELECT count(*) FROM proxied)::text")
    assert holding.wait_released()
    assert _notes(db_url) == {1: "x", 2: "1"}


def test_a_held_autocommit_statement_runs_only_when_released(holding: FaultProxy, table: str, db_url: str) -> None:
    with psycopg.connect(holding.url(), autocommit=True) as conn:
        holding.reset()
        holding.arm(Fault.HOLD_COMMIT, at=1)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("INSERT INTO proxied VALUES (%s, 'x')", (7,))
    assert _notes(db_url) == {}
    holding.release()
    assert holding.wait_released()
    assert holding.fired is not None and holding.fired.commits and holding.fired.tags == ["INSERT 0 1"]
    assert _notes(db_url) == {7: "x"}


def test_a_held_statement_mid_transaction_is_run_then_rolled_back(holding: FaultProxy, table: str,
                                                                  db_url: str) -> None:
    holding.arm(Fault.HOLD_COMMIT, match=lambda r: r.text.startswith("UPDATE"))
    with pytest.raises(psycopg.OperationalError), psycopg.connect(holding.url()) as first, first.transaction():
        first.execute("INSERT INTO proxied VALUES (3, 'x')")
        first.execute("UPDATE proxied SET note = 'y' WHERE id = 3")
    # the retry waits on the held transaction's row; the statement is released, then
    # its connection closed: the transaction rolls back and the retry goes on
    _insert_in_transaction(holding.url(), 3)
    assert holding.wait_released()
    assert _notes(db_url) == {3: "x"}


def _copy_rows_in_a_thread(url: str) -> tuple[threading.Thread, dict[str, Any]]:
    """``COPY proxied FROM STDIN`` of one row, in a thread (a hang must fail the test,
    never hang it); ``out`` gets the error it raised, or ``done``."""
    out: dict[str, Any] = {}

    def copy() -> None:
        try:
            with psycopg.connect(url) as conn, conn.cursor() as cur, cur.copy("COPY proxied FROM STDIN") as rows:
                rows.write_row((1, "a"))
            out["done"] = True
        except psycopg.Error as exc:
            out["error"] = exc

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread, out


def _is_copy(request: Any) -> bool:
    return str(request.text).startswith("COPY")


def test_a_lost_acknowledgement_of_a_copy_from_the_client_cuts_it_when_the_server_asks_for_the_rows(
        proxy: FaultProxy, table: str, db_url: str) -> None:
    """The server answers ``COPY ... FROM STDIN`` by asking for the rows
    (CopyInResponse) and completes it only once they came: the fault cuts the
    connection at that answer (the server rolls the COPY back). Withholding it
    left the server waiting for rows and the client for the answer, for ever."""
    proxy.arm(Fault.LOSE_ACK, match=_is_copy)
    thread, out = _copy_rows_in_a_thread(proxy.url())
    thread.join(30)
    assert not thread.is_alive(), "the COPY hung: the server waits for rows, the client for its answer"
    assert isinstance(out.get("error"), psycopg.OperationalError), out
    assert proxy.fired is not None and _is_copy(proxy.fired)
    assert _ids(db_url) == []


def test_a_held_copy_from_the_client_is_answered_once_the_server_asks_for_the_rows(
        proxy: FaultProxy, table: str, db_url: str) -> None:
    """A held ``COPY ... FROM STDIN`` reaches the server after its client was cut: no
    one is left to send the rows, so the connection closes when the server asks for
    them, and the held request counts as answered (the sweep waits for that)."""
    proxy.arm(Fault.HOLD_COMMIT, match=_is_copy)
    thread, out = _copy_rows_in_a_thread(proxy.url())
    thread.join(30)
    assert not thread.is_alive() and isinstance(out.get("error"), psycopg.OperationalError), out
    proxy.release()
    assert proxy.wait_released(30), "the held COPY was never answered"
    assert _ids(db_url) == []
