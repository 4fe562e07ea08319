"""repo/outbox.py's claim (sql/R__claim.sql) against the planner: a claim takes at
most its limit, whatever the statistics of the outbox say."""

from __future__ import annotations

import psycopg

from composer_ops import Engine


def test_a_claim_takes_no_more_than_its_limit_when_the_outbox_looks_empty(engine: Engine, db_url: str) -> None:
    """A queue is often drained when it is analysed: its statistics then say one page,
    no rows, and the planner put the whole outbox on the outer side of a nested loop and
    ran the pick (ORDER BY ... LIMIT ... FOR UPDATE SKIP LOCKED) once per outbox row,
    each run skipping the rows the statement had already deleted: a claim of one took
    every ready task (3 of 3 here), leased to a worker with room for one."""
    engine.deploy({"id": "once", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    engine.start("once")
    assert len(engine.claim(["default"], "w", 1)) == 1
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ANALYZE task_outbox")          # drained: one page, no rows
    for _ in range(3):
        engine.start("once")
    assert len(engine.claim(["default"], "w", 1)) == 1
    assert len(engine.claim(["default"], "w", 5)) == 2
