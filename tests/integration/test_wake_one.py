"""A dispatch wakes one idle worker, not every worker listening.

An idle worker is registered by its own claim (one that got less than it asked for)
and woken on its own channel; only a dispatch that finds no registered worker
notifies the shared channel.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, Worker
from composer_ops.repo import clock, outbox, tasks
from composer_ops.repo.rows import Dispatch
from composer_ops.testing.processes import TERMINAL, wait_for
from tests.integration.helpers import add_definition, add_run


def _dispatch(conn: Any, run_id: str, task_name: str = "t", queue: str = "default") -> None:
    task_id = f"{run_id[:8]}-{task_name}"
    now = clock.now(conn)
    assert tasks.insert_task(conn, run_id, task_id=task_id, node_id=task_name, node_type="TASK", queue=queue,
                             state="PENDING", now=now)
    outbox.enqueue(conn, [Dispatch(run_id=run_id, task_id=task_id, attempt=0, queue=queue, task_name=task_name,
                                   lease_s=30)], now=now)


def _idle(conn: Any, worker: str, names: list[str] | None = None) -> None:
    """An empty claim of ``worker`` with its wake channel: registers it as idle."""
    assert outbox.claim(conn, ["default"], worker, 2, task_names=names, claim_id=f"idle-{worker}",
                        wake=outbox.wake_channel(worker)) == []


@pytest.fixture
def heard(db_url: str) -> Iterator[tuple[psycopg.Connection[Any], dict[str, str]]]:
    """A connection listening on the shared channel and on the wake channels of
    workers a, b and c (by channel name -> worker)."""
    channels = {outbox.CHANNEL: "shared", **{outbox.wake_channel(w): w for w in "abc"}}
    with psycopg.connect(db_url, autocommit=True) as listen:
        for channel in channels:
            outbox.listen(listen, channel)
        yield listen, channels


def _notified(listen: psycopg.Connection[Any], channels: dict[str, str]) -> list[str]:
    return sorted(channels[n.channel] for n in listen.notifies(timeout=0.5))


def test_one_dispatch_wakes_the_most_recently_idle_worker_only(
        db_url: str, heard: tuple[psycopg.Connection[Any], dict[str, str]]) -> None:
    listen, channels = heard
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        _idle(conn, "a")
        _idle(conn, "b")
        _dispatch(conn, add_run(conn))
        assert _notified(listen, channels) == ["b"]
        _dispatch(conn, add_run(conn))                  # b's registration was used: a is next
        assert _notified(listen, channels) == ["a"]
        _dispatch(conn, add_run(conn))                  # nobody registered: every worker is told
        assert _notified(listen, channels) == ["shared"]


def test_a_dispatch_of_several_tasks_wakes_as_many_workers(
        db_url: str, heard: tuple[psycopg.Connection[Any], dict[str, str]]) -> None:
    listen, channels = heard
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        for w in "abc":
            _idle(conn, w)
        run_id = add_run(conn)
        now = clock.now(conn)
        for node in ("x", "y"):
            assert tasks.insert_task(conn, run_id, task_id=f"{run_id[:8]}-{node}", node_id=node,
                                     node_type="TASK", queue="default", state="PENDING", now=now)
        outbox.enqueue(conn, [Dispatch(run_id=run_id, task_id=f"{run_id[:8]}-{node}", attempt=0, queue="default",
                                       task_name="t", lease_s=30) for node in ("x", "y")], now=now)
        assert _notified(listen, channels) == ["b", "c"]


def test_a_worker_without_a_handler_for_the_task_is_not_woken(
        db_url: str, heard: tuple[psycopg.Connection[Any], dict[str, str]]) -> None:
    listen, channels = heard
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        _idle(conn, "a", names=["t"])
        _idle(conn, "b", names=["other"])
        _dispatch(conn, add_run(conn), task_name="t")
        assert _notified(listen, channels) == ["a"]


def test_a_claim_that_gets_all_it_asked_for_withdraws_the_registration(
        db_url: str, heard: tuple[psycopg.Connection[Any], dict[str, str]]) -> None:
    listen, channels = heard
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        _idle(conn, "a")
        conn.execute("DELETE FROM task_waiters WHERE worker = 'a'")   # as a dispatch that woke it
        _dispatch(conn, add_run(conn))
        _dispatch(conn, add_run(conn))
        assert _notified(listen, channels) == ["shared", "shared"]
        got = outbox.claim(conn, ["default"], "a", 2, claim_id="full", wake=outbox.wake_channel("a"))
        assert len(got) == 2
        _dispatch(conn, add_run(conn))                  # a is busy: not registered
        assert _notified(listen, channels) == ["shared"]
        assert conn.execute("SELECT count(*) FROM task_waiters").fetchone() == (0,)


def test_a_rolled_back_dispatch_wakes_nobody_and_keeps_the_registration(
        db_url: str, heard: tuple[psycopg.Connection[Any], dict[str, str]]) -> None:
    listen, channels = heard
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        _idle(conn, "a")
        run_id = add_run(conn)
        with conn.transaction():
            _dispatch(conn, run_id)
            raise psycopg.Rollback()
    assert _notified(listen, channels) == []
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute("SELECT worker FROM task_waiters").fetchall() == [("a",)]


ONE = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "noop"}]}


def test_four_idle_workers_one_run_at_a_time_few_empty_claims(db_url: str) -> None:
    """Four idle workers of 4 slots, one run at a time: each dispatch wakes one worker,
    so a claim comes back empty only when a wake-up races a poll (with every worker
    woken by each dispatch, three claims in four would be empty). A worker whose claim
    filled its last slot claims again when a slot frees, since more may be waiting:
    with 1 slot that claim is empty whenever nothing is queued, so the slots here are 4."""
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(ONE)
        counts = {"claims": 0, "empty": 0}
        lock = threading.Lock()
        workers = []
        for i in range(4):
            w_engine = Engine.connect(db_url, pool_size=2)
            claim = w_engine.claim

            def counted(*args: Any, _claim: Any = claim, **kwargs: Any) -> Any:
                got = _claim(*args, **kwargs)
                with lock:
                    counts["claims"] += 1
                    counts["empty"] += not got
                return got

            w_engine.claim = counted  # type: ignore[method-assign]
            worker = Worker(w_engine, concurrency=4, poll_interval=5.0, worker_id=f"w{i}")
            worker.handler("noop")(lambda _input, _ctx: None)
            workers.append(worker)
        threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: counts["claims"] >= 4, what="every worker's first claim")
            wait_for(lambda: _waiting(engine) == 4, what="every worker registered")
            with lock:
                counts.update(claims=0, empty=0)
            for _ in range(20):
                run_id = engine.start("one")
                wait_for(partial(_finished, engine, run_id), what=f"run {run_id}")
                wait_for(lambda: _waiting(engine) == 4, what="every worker idle again")
        finally:
            for w in workers:
                w.stop()
            for t in threads:
                t.join(10)
            for w in workers:
                w.engine.close()
    assert counts["claims"] >= 20
    assert counts["empty"] <= 2, counts


def _finished(engine: Engine, run_id: str) -> bool:
    return engine.get_run(run_id).status in TERMINAL


def _waiting(engine: Engine) -> int:
    with engine.pool.connection() as conn:
        row = conn.execute("SELECT count(*) FROM task_waiters").fetchone()
        return int(row[0]) if row else 0
