"""The workers registry: workers register, show a sign of life once per interval (not
per task), stop cleanly, and a SIGKILLed one is listed dead with the leases it left."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, TaskContext, Worker
from composer_ops.cli import main
from composer_ops.testing.processes import Fleet, wait_for


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=4) as e:
        yield e


def _by_id(engine: Engine, worker_id: str) -> Any:
    return next((w for w in engine.workers().workers if w.id == worker_id), None)


def test_a_worker_registers_beats_once_per_interval_and_stops(db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "quick", "nodes": [{"id": "a", "type": "TASK", "task": "quick"}]})
    with psycopg.connect(db_url, autocommit=True) as conn:   # count every update of the registry
        conn.execute("""
            CREATE TABLE registry_updates(n INT NOT NULL);
            CREATE FUNCTION count_registry_update() RETURNS trigger LANGUAGE plpgsql AS
                $$ BEGIN INSERT INTO registry_updates VALUES (1); RETURN NEW; END $$;
            CREATE TRIGGER counted AFTER UPDATE ON workers FOR EACH ROW EXECUTE FUNCTION count_registry_update();""")
    worker = Worker(engine, queues=["default", "other"], concurrency=3, poll_interval=0.05, registry_interval=0.5)

    @worker.handler("quick")
    def quick(input: Any, ctx: TaskContext) -> dict[str, Any]:
        return {"ok": True}

    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        row = wait_for(lambda: _by_id(engine, worker.worker_id), what="the worker's registration")
        assert (row.state, row.queues, row.concurrency, row.heartbeat_s) == ("live", ["default", "other"], 3, 0.5)
        assert row.pid > 0 and row.host
        runs = [engine.start("quick") for _ in range(40)]
        wait_for(lambda: all(engine.get_run(r).status == "SUCCEEDED" for r in runs), what="40 runs")
        first_seen = row.last_seen_at
        wait_for(lambda: _by_id(engine, worker.worker_id).last_seen_at > first_seen, what="a registry heartbeat")
    finally:
        worker.stop()
        thread.join(60)
    stopped = _by_id(engine, worker.worker_id)
    assert stopped.state == "stopped" and stopped.stopped_at is not None and stopped.running == 0
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT count(*), extract(epoch FROM max(last_seen_at) - min(started_at)) "
                           "FROM registry_updates, workers").fetchone()
    assert row is not None
    updates, lifetime_s = int(row[0]), float(row[1])
    # One beat per 0.5 s interval plus the stop, whatever the 40 tasks: never one per task.
    assert updates <= lifetime_s / 0.5 + 2, (updates, lifetime_s)
    assert updates < 40


def test_a_killed_worker_is_dead_with_the_leases_it_left(db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "slowly", "nodes": [
        {"id": "long", "type": "TASK", "task": "slow", "queue": "slow", "lease_s": 2,
         "input": {"sleep": "$.input.sleep"}, "retry": {"max_attempts": 2, "initial_backoff_s": 0}}]})
    with Fleet(db_url) as fleet:
        doomed = fleet.worker("--registry-interval", "0.3", concurrency=1)
        run_id = engine.start("slowly", input={"sleep": 60})
        task = wait_for(lambda: next((t for t in engine.get_run(run_id).tasks if t.state == "RUNNING"), None),
                        what="the task to run")
        owner = task.lease_owner
        # The registry row is written by its own thread, which a loaded machine can let
        # the first claim overtake: wait for it rather than read it once.
        wait_for(lambda: (w := _by_id(engine, owner)) is not None and w.state == "live",
                 what="the worker's registration")
        fleet.kill(doomed)
        dead = wait_for(lambda: (w := _by_id(engine, owner)) is not None and w.state == "dead" and w,
                        timeout=60, what="the worker to be judged dead")
        assert dead.running == 1 and dead.silent_s >= 0.9
        report = engine.workers()
        assert [(lease.lease_owner, lease.run_id, lease.node_id, lease.attempt) for lease in report.leases] == [
            (owner, run_id, "long", 0)]
        wait_for(lambda: report.leases[0].lease_expires_at is not None, what="lease expiry")

        assert main(["workers", "list", "--database-url", db_url]) == 0
        # The sweeper re-queues the task once the lease lapses; a live worker finishes it.
        fleet.coordinator()
        fleet.worker("--registry-interval", "0.3", concurrency=1)
        wait_for(lambda: engine.get_run(run_id).tasks[0].attempt == 1, timeout=60, what="the re-queue")
    after = _by_id(engine, owner)
    assert after.state == "dead" and after.running == 0


def test_workers_list_json_names_leases_of_the_dead(db_url: str, engine: Engine,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    engine.deploy({"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t", "lease_s": 600}]})
    run_id = engine.start("one")
    assert len(engine.claim(["default"], "gone-host:123:abcd", 1)) == 1
    engine.start("one")
    assert len(engine.claim(["default"], "never-registered:9:ffff", 1)) == 1
    engine.register_worker("gone-host:123:abcd", host="gone-host", pid=123, queues=["default"], concurrency=1,
                           heartbeat_s=1.0)
    engine.register_worker("alive-host:1:0001", host="alive-host", pid=1, queues=["default"], concurrency=2,
                           heartbeat_s=3600.0)
    with psycopg.connect(db_url) as conn:   # the first worker was last seen a minute ago
        conn.execute("UPDATE workers SET last_seen_at = now() - interval '1 minute' WHERE id = 'gone-host:123:abcd'")
    capsys.readouterr()
    assert main(["workers", "list", "--json", "--database-url", db_url]) == 0
    out = json.loads(capsys.readouterr().out)
    states = {w["id"]: (w["state"], w["running"], [lease["run_id"] for lease in w["leases"]]) for w in out["workers"]}
    assert states == {"alive-host:1:0001": ("live", 0, []), "gone-host:123:abcd": ("dead", 1, [run_id])}
    assert [w["id"] for w in out["workers"]] == ["alive-host:1:0001", "gone-host:123:abcd"]   # live first
    assert out["unregistered_lease_owners"] == ["never-registered:9:ffff"]
    assert main(["workers", "list", "--window", "-1", "--database-url", db_url]) == 2
