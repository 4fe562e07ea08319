"""One clock per event on Citus: everything an event decides and writes carries the one
instant its transaction read on the coordinator (composer_ops/repo/clock.py).

The event's statements run on the worker node that holds the run's shard. There,
``now()`` is that node's clock at the start of its part of the transaction; Citus
evaluates the ``now()`` of INSERTs and UPDATEs on the coordinator instead. An event
that mixed the two would schedule a timer from one instant and stamp the rows it
wrote with another (on one machine they differ by milliseconds, across machines by
the clocks' skew as well)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

from composer_ops import Engine

SPEC = {"id": "then-wait", "nodes": [{"id": "a", "type": "TASK", "task": "t"},
                                     {"id": "sleep", "type": "WAIT", "duration_s": 60, "depends_on": ["a"]}]}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=2) as e:
        e.deploy(SPEC)
        yield e


def test_a_completion_stamps_its_rows_and_schedules_its_timer_at_one_instant(db_url: str, engine: Engine) -> None:
    for _ in range(5):
        run_id = engine.start("then-wait")
        claim = engine.claim(["default"], "w", 1)[0]
        engine.complete(claim, {"done": True})
        with psycopg.connect(db_url) as conn:
            finished, updated = conn.execute(
                "SELECT finished_at, updated_at FROM task_instances WHERE run_id = %s AND node_id = 'a'",
                (run_id,)).fetchone() or (None, None)
            wake, scheduled, created = conn.execute(
                "SELECT wake_at, scheduled_at, created_at FROM task_instances WHERE run_id = %s AND node_id = 'sleep'",
                (run_id,)).fetchone() or (None, None, None)
            noted = [r[0] for r in conn.execute(
                "SELECT at FROM run_history WHERE run_id = %s AND kind = 'completed'", (run_id,))]
        instant = wake - timedelta(seconds=60)         # the machine's: the event's now + duration_s
        assert finished == updated == scheduled == created == instant, (finished, scheduled, instant)
        assert noted == [instant]
