"""Connection faults: the pool, the LISTEN connection, a worker and a coordinator all
carry on after PostgreSQL restarts (``pg_ctl restart -m fast``: every session is
terminated), and a worker or coordinator started while the server is down waits for
it. Skipped on a COMPOSER_DATABASE_URL server, which is not ours to restart."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, TaskContext, Worker
from composer_ops.engine.listener import Listener
from composer_ops.testing.processes import Fleet, wait_for
from composer_ops.testing.servers import Server

SPEC = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]}


@pytest.fixture
def restartable(server: Server) -> Server:
    if not server.owned:
        pytest.skip("the server comes from COMPOSER_DATABASE_URL; it is not ours to restart")
    return server


@pytest.fixture
def engine(engine: Engine) -> Engine:
    engine.deploy(SPEC)
    return engine


def _fill_pool(engine: Engine, n: int = 4) -> None:
    """Open ``n`` pooled connections at once, so all of them die in the restart."""
    barrier = threading.Barrier(n)

    def hold() -> None:
        with engine.pool.connection() as conn:
            conn.execute("SELECT 1")
            barrier.wait(10)

    threads = [threading.Thread(target=hold) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.pool.get_stats()["pool_size"] == n


def test_the_pool_hands_out_only_live_connections_after_a_restart(engine: Engine, restartable: Server,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    before = engine.start("one")
    _fill_pool(engine)
    restartable.restart()
    caplog.set_level(logging.WARNING, logger="composer_ops")
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(engine.get_run(before).status)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = engine.start("one")
    assert results == ["RUNNING"] * 4 and engine.get_run(after).status == "RUNNING"
    # check_connection discarded the dead connections: no statement failed, nothing was retried
    assert not [r for r in caplog.records if "transient database error" in r.getMessage()]


def test_the_listen_connection_reconnects_after_a_restart(db_url: str, restartable: Server) -> None:
    got: list[str] = []
    stop = threading.Event()
    listener = Listener(db_url, "composer_tasks", lambda _channel, payload: got.append(payload), stop)
    listener.start()

    def notify_until_heard(payload: str) -> None:
        def heard() -> bool:
            with psycopg.connect(db_url, autocommit=True) as conn:
                conn.execute("SELECT pg_notify('composer_tasks', %s)", (payload,))
            time.sleep(0.2)
            return payload in got
        wait_for(heard, timeout=60, interval=0.1, what=f"NOTIFY {payload} to be heard")

    try:
        notify_until_heard("before")
        restartable.restart()
        notify_until_heard("after")
        assert listener.is_alive()
    finally:
        stop.set()
        listener.join(5)


def test_a_worker_and_a_coordinator_carry_on_after_a_restart(engine: Engine, restartable: Server) -> None:
    worker = Worker(engine, concurrency=2, poll_interval=0.2)
    done: list[str] = []

    @worker.handler("t")
    def t(input: Any, ctx: TaskContext) -> dict[str, Any]:
        done.append(ctx.run_id)
        return {}

    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    coordinator = engine.coordinator()
    try:
        first = engine.start("one")
        wait_for(lambda: engine.get_run(first).status == "SUCCEEDED", timeout=60, what="the first run")
        restartable.restart()
        second = engine.start("one")
        wait_for(lambda: engine.get_run(second).status == "SUCCEEDED", timeout=60, what="the run after the restart")
        assert coordinator.run_once().errors == []
    finally:
        worker.stop()
        thread.join(60)
    assert done == [first, second]


def test_a_worker_and_a_coordinator_started_while_the_server_is_down_wait_for_it(db_url: str,
                                                                                  restartable: Server) -> None:
    # A worker respawned during `pg_ctl restart` meets "the database system is shutting
    # down": services wait for the server (--connect-wait, 60 s by default), and
    # --connect-wait 0 exits 1 at once.
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy({"id": "later", "nodes": [{"id": "a", "type": "TASK", "task": "work"}]})
    fleet = Fleet(db_url)
    try:
        with restartable.down():
            impatient = fleet.worker("--connect-wait", "0", concurrency=1)
            worker = fleet.worker(concurrency=2)
            coordinator = fleet.coordinator("--connect-wait", "60")
            assert impatient.popen.wait(30) == 1
            refused = impatient.stderr()
            time.sleep(1.5)                  # a few attempts each, while the server stays down
            assert worker.alive() and coordinator.alive()
        with Engine.connect(db_url, pool_size=1) as engine:
            run_id = engine.start("later", {"sleep": 0})
            wait_for(lambda: engine.get_run(run_id).status == "SUCCEEDED", timeout=30, what="the run")
        assert worker.alive() and coordinator.alive()
        waited = worker.stderr()
    finally:
        fleet.stop()
    assert "composer-ops: unavailable: cannot connect to the database: " in refused, refused
    assert "cannot connect to the database yet" in waited and "connected to the database after" in waited, waited
