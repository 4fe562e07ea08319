"""A start in one round trip (engine/starts.py): decided with an estimate of the database
clock and a cached definition version, both checked by the server (sql/R__apply.sql)."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.core.runids import uuid7_timestamp
from composer_ops.errors import Invalid

WAITS = {"id": "waits", "config": {"v": 1}, "nodes": [{"id": "nap", "type": "WAIT", "duration_s": 60}]}


def test_a_start_decided_with_a_late_estimate_writes_the_servers_instants(db_url: str) -> None:
    """The estimate is ten minutes behind the database: the run ID is stamped with it (and
    accepted, an hour being the window), but the timer wakes 60 s after the run's creation
    by the database clock, not ten minutes early."""
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy(WAITS)
        engine.start("waits")                                   # caches the version, calibrates
        engine.shell.clock_offset -= timedelta(minutes=10)
        run_id = engine.start("waits")
        run = engine.get_run(run_id)
    (nap,) = run.tasks
    assert nap.wake_at == nap.created_at + timedelta(seconds=60) == run.created_at + timedelta(seconds=60)
    assert run.created_at - uuid7_timestamp(run_id) > timedelta(minutes=9)


def test_a_run_id_minted_from_an_estimate_too_far_ahead_is_refused_then_the_estimate_is_corrected(
        db_url: str) -> None:
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy(WAITS)
        engine.start("waits")
        engine.shell.clock_offset += timedelta(minutes=30)
        with pytest.raises(Invalid, match="after the database clock"):
            engine.start("waits")
        run_id = engine.start("waits")                          # the refusal carried the clock
        assert abs(engine.get_run(run_id).created_at - uuid7_timestamp(run_id)) < timedelta(minutes=1)
    with psycopg.connect(db_url) as conn:                       # the refused start wrote nothing
        assert conn.execute("SELECT count(*) FROM workflow_runs").fetchone() == (2,)


def test_a_cached_version_no_longer_deployed_or_enabled_is_checked_by_the_server(db_url: str) -> None:
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy(WAITS)
        first = engine.start("waits")
        engine.deploy({**WAITS, "config": {"v": 2}})
        second = engine.start("waits")                          # read again, once
        assert [engine.get_run(r).workflow_version for r in (first, second)] == [1, 2]
        engine.set_enabled("waits", False)
        with pytest.raises(Invalid, match="disabled"):
            engine.start("waits")
        with pytest.raises(Invalid, match="disabled"):
            engine.start("waits", version=1)


def test_a_start_that_raises_before_its_pipeline_is_synced_writes_nothing(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-statement start is queued in a pipeline on a connection in autocommit, whose
    sync commits what was queued. An exception raised in the client after the statement was
    queued and before the sync (a bug, an interrupt) reaches the caller: the start must not
    be committed behind its back, or a caller that starts again has two runs."""
    from composer_ops.repo import writes

    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy(WAITS)
        engine.start("waits")                                   # caches the version, calibrates
        real = writes.send

        def send_then_raise(conn: psycopg.Connection[object], doc: dict[str, object]) -> writes.Pending:
            real(conn, doc)
            raise RuntimeError("raised after the start's statement was queued")

        monkeypatch.setattr(writes, "send", send_then_raise)
        with pytest.raises(RuntimeError, match="was queued"):
            engine.start("waits")
        monkeypatch.setattr(writes, "send", real)
        engine.start("waits")                                   # the pool lends a working connection
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM workflow_runs").fetchone() == (2,)


def test_a_start_refused_in_the_callers_transaction_leaves_it_usable(db_url: str) -> None:
    """A SUB_WORKFLOW child's or a schedule slot's start (``start_in``) runs in its caller's
    transaction. The statement raises when the database refuses it (CO412), so it runs
    under a savepoint: a taken run ID is a Conflict, a disabled workflow Invalid, and the
    caller's transaction goes on and commits what it wrote before and after."""
    from composer_ops.engine.requests import Request
    from composer_ops.engine.starts import start_in
    from composer_ops.errors import Conflict

    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy(WAITS)
        engine.deploy({**WAITS, "id": "off"})
        engine.set_enabled("off", False)
        taken = engine.start("waits")
        with engine.pool.connection() as conn, conn.transaction():
            conn.execute("CREATE TABLE before_and_after (n int)")
            conn.execute("INSERT INTO before_and_after VALUES (1)")
            with pytest.raises(Conflict, match="already exists"):
                start_in(conn, engine.shell, workflow_id="waits", version=None, input=None, run_id=taken,
                         minted=[], request=Request())
            with pytest.raises(Invalid, match="disabled"):
                start_in(conn, engine.shell, workflow_id="off", version=None, input=None, run_id=None,
                         minted=[], request=Request())
            started, _ = start_in(conn, engine.shell, workflow_id="waits", version=None, input=None, run_id=None,
                                  minted=[], request=Request())
            conn.execute("INSERT INTO before_and_after VALUES (2)")
    with psycopg.connect(db_url) as check:
        assert check.execute("SELECT array_agg(n ORDER BY n) FROM before_and_after").fetchone() == ([1, 2],)
        assert check.execute("SELECT id FROM workflow_runs ORDER BY id").fetchall() == sorted(
            [(taken,), (started,)])
        assert check.execute("SELECT count(*) FROM task_instances").fetchone() == (2,)
        assert check.execute("SELECT count(*) FROM run_history WHERE kind = 'started'").fetchone() == (2,)


def test_a_refused_start_writes_none_of_its_rows(db_url: str) -> None:
    """Each refusal (a run ID outside the window, a month without a partition, a disabled
    workflow, a taken run ID) raises before the start's statement could write its task,
    history or outbox rows, or rolls them back with it."""
    from composer_ops.engine.ids import uuid7_at
    from composer_ops.engine.requests import Request
    from composer_ops.engine.starts import start_in
    from composer_ops.errors import Conflict
    from tests.integration.helpers import now_utc

    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy({"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        taken = engine.start("one")
        with pytest.raises(Invalid, match="before the database clock"):
            engine.start("one", run_id=uuid7_at(now_utc() - timedelta(hours=2)))
        with engine.pool.connection() as conn, pytest.raises(Invalid, match="no partition holds"):
            start_in(conn, engine.shell, workflow_id="one", version=None, input=None, derived=True,
                     run_id=uuid7_at(now_utc() + timedelta(days=2000)), minted=[], request=Request())
        with pytest.raises(Conflict, match="already exists"):
            engine.start("one", run_id=taken)
        engine.set_enabled("one", False)
        with pytest.raises(Invalid, match="disabled"):
            engine.start("one")
    with psycopg.connect(db_url) as conn:
        counts = conn.execute("""SELECT (SELECT count(*) FROM workflow_runs), (SELECT count(*) FROM task_instances),
                                        (SELECT count(*) FROM task_outbox),
                                        (SELECT array_agg(DISTINCT run_id) FROM run_history)""")
        assert counts.fetchone() == (1, 1, 1, [taken])      # the first run's rows only


def test_a_start_locks_nothing_of_its_definition(db_url: str) -> None:
    """Until V019 the runs' foreign key locked the definition's row FOR KEY SHARE at every
    start: a row lock written to the WAL, and a MultiXact when starts of the definition
    ran side by side. The start checks the version itself, in its statement."""
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy(WAITS)
        with psycopg.connect(db_url, autocommit=True) as conn:
            before = conn.execute("SELECT xmin, xmax FROM workflow_definitions WHERE id = 'waits'").fetchone()
            assert before is not None
            for _ in range(3):
                engine.start("waits")
            assert conn.execute("SELECT xmin, xmax FROM workflow_definitions WHERE id = 'waits'").fetchone() == before
