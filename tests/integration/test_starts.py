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
