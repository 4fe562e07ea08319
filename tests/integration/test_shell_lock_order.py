"""One lock order for tasks and their outbox rows: outbox row first, then task.

The claim takes them in that order by construction (one statement: its DELETE of the
outbox rows feeds its UPDATE of the tasks). Here a transaction holds the claim's first
lock (an outbox row, deleted) while a cancel of the same run starts, then takes the
claim's second (the task row). Were the cancel to lock the task before the outbox
row, the two would deadlock: PostgreSQL would abort one after deadlock_timeout (a
second by default) and the engine would retry it, stalled.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.testing.processes import wait_for


def _blocked_on_a_lock(db_url: str, application_name: str) -> bool:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                           "AND wait_event_type = 'Lock'", (application_name,)).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("path", ["cancel", "failure"])
def test_a_claim_and_a_cancel_of_its_task_never_deadlock(engine: Engine, db_url: str, path: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """``cancel``: the run is cancelled. ``failure``: another task of the run fails for
    good, which cancels the run's other active tasks: the same write."""
    caplog.set_level(logging.WARNING, logger="composer_ops")
    engine.deploy({"id": "pair", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "qa"},
                                           {"id": "b", "type": "TASK", "task": "t", "queue": "qb"}]})
    run_id = engine.start("pair")
    [failing] = engine.claim(["qa"], "w-a", 1) if path == "failure" else [None]
    with psycopg.connect(db_url) as claimer:
        claimer.execute("SET application_name = 'test-claimer'")
        # The claim's first step: delete (lock) task b's outbox row.
        row = claimer.execute("DELETE FROM task_outbox WHERE run_id = %s AND queue = 'qb' RETURNING task_id, attempt",
                              (run_id,)).fetchone()
        assert row is not None
        task_id, attempt = row
        done: list[Any] = []

        def act() -> None:
            started = time.monotonic()
            if path == "cancel":
                done.append(engine.cancel(run_id, reason="stop"))
            else:
                assert failing is not None
                done.append(engine.fail(failing, "fatal", retryable=False))
            done.append(time.monotonic() - started)

        thread = threading.Thread(target=act)
        with engine.pool.connection() as conn:      # name the pool's connections, to see them wait
            conn.execute("SET application_name = 'test-engine'")
        thread.start()
        wait_for(lambda: _blocked_on_a_lock(db_url, "test-engine") or done, timeout=60,
                 what="the cancel to wait for the claimed outbox row")
        # The claim's second step, while the cancel waits: move task b to RUNNING.
        began = time.monotonic()
        claimer.execute("SET lock_timeout = '5s'")
        updated = claimer.execute("""
            UPDATE task_instances SET state = 'RUNNING', lease_owner = 'w-b',
                   lease_expires_at = now() + interval '30 s', started_at = now()
             WHERE run_id = %s AND id = %s AND attempt = %s AND state IN ('PENDING', 'QUEUED')""",
                                  (run_id, task_id, attempt)).rowcount
        waited = time.monotonic() - began
        claimer.commit()
    thread.join(30)
    # Had the claim queued behind the cancel it would deadlock (the cancel waits for the
    # claimer's outbox row): one side aborted after deadlock_timeout (1 s) and retried, which
    # the next assertion sees; the time is a second, looser witness for a loaded machine.
    assert updated == 1 and waited < 3.0, f"the claim waited {waited:.2f}s for the task row"
    retried = [r.getMessage() for r in caplog.records if "transient database error" in r.getMessage()]
    assert retried == [], retried                        # no deadlock was detected and retried
    assert done and done[0].applied, done
    run = engine.get_run(run_id)
    assert run.status == ("CANCELLED" if path == "cancel" else "FAILED")
    assert {t.node_id: t.state for t in run.tasks}["b"] == "CANCELLED"   # claimed, then cancelled
    with engine.pool.connection() as conn:
        row = conn.execute("SELECT count(*) FROM task_outbox WHERE run_id = %s", (run_id,)).fetchone()
    assert row == (0,)
