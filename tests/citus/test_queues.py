"""On Citus too (tests/integration/test_queues.py's single-server twin, as far as the
Citus claim goes): a paused queue gives no task and keeps them, priorities order the
claim (within a shard: the runs are placed on one), start_to_close caps the lease, and a
task not claimed by its schedule_to_start deadline fails its run."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.testing.citus import run_ids_on_one_shard


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=4) as e:
        e.deploy({"id": "low", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "q"}]})
        e.deploy({"id": "high", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "q", "priority": 5,
                                           "timeouts": {"start_to_close_s": 5, "schedule_to_start_s": 60}}]})
        yield e


def test_pause_priority_and_timeouts(db_url: str, engine: Engine) -> None:
    ids = run_ids_on_one_shard(db_url, 2)
    low = engine.start("low", run_id=ids[0])
    high = engine.start("high", run_id=ids[1])
    engine.queues.pause("q", reason="incident")
    assert engine.claim(["q"], "w", 10) == []
    assert {r.queue: r.depth for r in engine.queues.list()} == {"q": 2}
    engine.queues.resume("q")
    first = engine.claim(["q"], "w", 1)
    assert [c.run_id for c in first] == [high] and first[0].lease_s == 5
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT extract(epoch FROM run_deadline_at - started_at)::int FROM task_instances "
                           "WHERE run_id = %s", (high,)).fetchone()
    assert row == (5,)
    assert [c.run_id for c in engine.claim(["q"], "w", 1)] == [low]
    late = engine.start("high")
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_outbox SET start_by = now() - interval '1 millisecond' WHERE run_id = %s", (late,))
    assert engine.coordinator().run_once(["timers"]).start_timeouts == 1
    run = engine.get_run(late)
    assert run.status == "FAILED" and "schedule_to_start timeout" in str(run.error)


def test_a_node_claim_of_two_queues_takes_a_shards_rows_in_one_order(db_url: str, engine: Engine) -> None:
    """The node claim reads each queue of a shard on its own, in its index's order, and
    takes the first of them all: priority, then age, across the queues of the shard."""
    engine.deploy({"id": "other", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "r"}]})
    engine.deploy({"id": "other-high", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "r",
                                                  "priority": 7}]})
    ids = run_ids_on_one_shard(db_url, 6)
    first = engine.start("low", run_id=ids[0])
    other = engine.start("other", run_id=ids[1])
    second = engine.start("low", run_id=ids[2])
    high = engine.start("high", run_id=ids[3])
    top = engine.start("other-high", run_id=ids[4])
    later = engine.start("other", run_id=ids[5])
    taken = [c.run_id for _ in range(6) for c in engine.claim(["r", "q"], "w", 1)]
    assert taken == [top, high, first, other, second, later]
    assert engine.claim(["q", "r"], "w", 1) == []
