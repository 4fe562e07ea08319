"""Faults at the Engine's boundary: a connection lost after COMMIT, and driver errors,
which reach callers only as ComposerErrors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from psycopg.pq import Trace, TransactionStatus

from composer_ops import ComposerError, Conflict, Engine, Unavailable
from composer_ops.db import make_pool
from tests.integration.helpers import LoseAck, now_utc, uuid7_at

SPEC = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]}


@pytest.fixture
def engine(engine: Engine) -> Engine:
    engine.deploy(SPEC)
    return engine


def _runs(engine: Engine) -> list[str]:
    with engine.pool.connection() as conn:
        return [r[0] for r in conn.execute("SELECT id FROM workflow_runs ORDER BY id")]


def test_a_lost_commit_acknowledgement_does_not_start_a_second_run(engine: Engine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.pool, "connection", LoseAck(engine))
    run_id = engine.start("one")
    monkeypatch.undo()
    assert _runs(engine) == [run_id]
    assert [t.node_id for t in engine.get_run(run_id).tasks] == ["a"]


def test_with_a_client_run_id_the_retry_returns_the_run(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry recognises the run its lost attempt started (the run's 'started'
    history row carries the call's request ID): the run, never a Conflict, never a
    second run. A new start of that ID is still a Conflict."""
    run_id = uuid7_at(now_utc())
    monkeypatch.setattr(engine.pool, "connection", LoseAck(engine))
    assert engine.start("one", run_id=run_id) == run_id
    monkeypatch.undo()
    assert _runs(engine) == [run_id]
    with pytest.raises(Conflict, match="already exists"):
        engine.start("one", run_id=run_id)


def test_driver_errors_reach_callers_as_composer_errors(db_url: str) -> None:
    engine = Engine(make_pool(db_url, min_size=1, max_size=1), db_url)
    engine.pool.timeout = 0.05          # once open: opening on a loaded machine may take longer
    try:
        engine.deploy(SPEC)
        run_id = engine.start("one")
        with engine.pool.connection():            # the only connection is taken
            for call in (lambda: engine.get_run(run_id), lambda: engine.signal(run_id, "x"),
                         lambda: engine.start("one"), lambda: engine.set_enabled("one", False)):
                with pytest.raises(Unavailable) as caught:
                    call()
                assert isinstance(caught.value, ComposerError) and "retried" in str(caught.value)
    finally:
        engine.close()


def test_a_claim_is_one_autocommit_statement_and_its_connection_goes_back_as_lent(db_url: str,
                                                                                  tmp_path: Path) -> None:
    """No BEGIN/COMMIT around the claim's single statement; after it, and after a
    claim the server refuses, the pool's only connection is idle and in autocommit,
    as the pool lends its connections."""
    engine = Engine(make_pool(db_url, min_size=1, max_size=1), db_url)
    trace = tmp_path / "libpq.trace"
    fd = os.open(trace, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        engine.deploy(SPEC)
        engine.start("one")
        # An engine's first claim also asks whether the database is a Citus coordinator
        # (once per engine); traced below are the claims after it.
        assert engine.claim(["no-such-queue"], "w", 5) == []
        with engine.pool.connection() as conn:
            conn.pgconn.trace(fd)
            conn.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS)
        claims = engine.claim(["default"], "w", 5)
        with pytest.raises(ComposerError):
            engine.claim(["default"], "w", 2**31)        # not an INT: the server finds no such function
        with engine.pool.connection() as conn:
            conn.pgconn.untrace()
            assert conn.autocommit is True and conn.info.transaction_status == TransactionStatus.IDLE
        assert [c.node_id for c in claims] == ["a"]
        sent = [line.split("\t")[2] for line in trace.read_text().splitlines() if line.startswith("F\t")]
        # Two claims, each one extended-protocol statement ending in one Sync (one round
        # trip); BEGIN and COMMIT would be simple-protocol Query messages.
        assert sent.count("Parse") == 2 and sent.count("Sync") == 2, sent
        assert "Query" not in sent, sent
    finally:
        os.close(fd)
        engine.close()
