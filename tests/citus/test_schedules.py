"""Schedules on Citus (mirrors tests/integration/test_schedules.py): the schedule tables
stay plain tables on the coordinator, and each slot's run, started by a coordinator
pass, a trigger or a backfill, lives on its own shard with its history, reached by
one-shard router queries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from composer_ops import Engine
from composer_ops.core.schedules import slot_run_id

SPEC = {"id": "nightly", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]}


def _one(url: str, query: str, params: Any = ()) -> Any:
    with psycopg.connect(url) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def test_slots_start_one_run_each_on_its_shard(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        tables = {r for (r,) in conn.execute("SELECT table_name::text FROM citus_tables").fetchall()}
    assert "schedules" not in tables and "schedule_events" not in tables
    top = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(SPEC)
        made = engine.schedules.create("hourly", workflow="nightly", cron="0 * * * *", timezone="Europe/Paris",
                                       catchup="all", overlap="allow")
        with psycopg.connect(db_url) as conn:      # two hours of slots due, as after an outage
            conn.execute("UPDATE schedules SET next_slot_at = %s, wake_at = %s WHERE id = %s",
                         (top - timedelta(hours=2), top - timedelta(hours=2), made.id))
        for _ in range(2):                          # two coordinators' passes: the second finds nothing due
            engine.coordinator().run_once(["schedules"])
        slots = [top - timedelta(hours=h) for h in (2, 1, 0)]
        fired = [slot_run_id(made.id, "cron", s) for s in slots]
        triggered = engine.schedules.trigger("hourly")
        done = engine.schedules.backfill("hourly", start=top - timedelta(hours=5), end=top - timedelta(hours=2),
                                         yes=True)
        assert done.started == 3
        runs = fired + [triggered] + [s.run_id for s in done.slots]
        for run_id in runs:
            assert engine.get_run(run_id).status == "RUNNING"
    assert _one(db_url, "SELECT count(*) FROM workflow_runs") == len(runs) == 7
    for run_id in runs:
        # The run and its history are co-located: one shard index for both tables.
        shards = _one(db_url, """
            SELECT array_agg(DISTINCT s.shardminvalue) FROM pg_dist_shard s
             WHERE s.shardid IN (get_shard_id_for_distribution_column('workflow_runs', %s::text),
                                 get_shard_id_for_distribution_column('run_history', %s::text))""",
                      (run_id, run_id))
        assert len(shards) == 1, run_id
        with psycopg.connect(db_url) as conn:
            plan = "\n".join(r[0] for r in conn.execute(
                "EXPLAIN SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchall())
        assert "Task Count: 1" in plan, plan
