"""Dispatch on Citus cannot lose a task.

The outbox lives on the coordinator and the task rows on the worker nodes, so a
transaction that creates a task and its outbox row commits with two-phase commit:
the coordinator's part first, then the workers' (COMMIT PREPARED). Between the two
a claimer can see the outbox row while the task row is not visible yet. The claim
must keep such a row for a later claim, and still drop a row whose task is no
longer PENDING (cancelled, or a stale attempt)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.engine.ids import uuid7_text

SPEC = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=8) as e:
        e.deploy(SPEC)
        yield e


def _outbox(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT run_id, task_id, attempt FROM task_outbox ORDER BY id").fetchall()


def test_an_outbox_row_whose_task_is_not_visible_yet_is_kept_and_claimed_later(db_url: str, engine: Engine) -> None:
    # The state two-phase commit leaves for a moment, held open here: the coordinator's
    # part (the outbox row) committed, the worker's part (the run and its task) not yet.
    run_id, task_id = uuid7_text(), uuid7_text()
    with psycopg.connect(db_url) as starter:
        starter.execute("""INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status)
                           VALUES (%s, 'one', 1, 'RUNNING')""", (run_id,))
        starter.execute("""INSERT INTO task_instances (id, run_id, node_id, node_type, queue, state)
                           VALUES (%s, %s, 'a', 'TASK', 'default', 'PENDING')""", (task_id, run_id))
        with psycopg.connect(db_url, autocommit=True) as coordinator_part:
            coordinator_part.execute("""INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s)
                                        VALUES ('default', %s, %s, 0, 't', 30)""", (run_id, task_id))
        assert engine.claim(["default"], "w1", 10) == []
        assert _outbox(db_url) == [(run_id, task_id, 0)]       # kept, not lost
        starter.commit()
    deadline = time.monotonic() + 5
    claims = engine.claim(["default"], "w1", 10)
    while not claims and time.monotonic() < deadline:         # a kept row may be delayed a little
        time.sleep(0.05)
        claims = engine.claim(["default"], "w1", 10)
    assert [(c.run_id, c.task_id, c.attempt) for c in claims] == [(run_id, task_id, 0)]
    assert _outbox(db_url) == []
    assert engine.get_run(run_id).tasks[0].state == "RUNNING"


def test_an_outbox_row_whose_task_is_no_longer_pending_is_dropped(db_url: str, engine: Engine) -> None:
    cancelled = engine.start("one")
    stale = engine.start("one")
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE task_instances SET state = 'CANCELLED' WHERE run_id = %s", (cancelled,))
        conn.execute("UPDATE task_instances SET attempt = 1 WHERE run_id = %s", (stale,))
    assert engine.claim(["default"], "w1", 10) == []
    assert _outbox(db_url) == []


def test_two_phase_commit_starts_against_concurrent_claimers_lose_no_task(db_url: str, engine: Engine) -> None:
    starts, claimers = 600, 4
    started: list[str] = []
    claimed: Counter[str] = Counter()
    done = threading.Event()
    errors: list[BaseException] = []

    def start(n: int) -> None:
        try:
            for _ in range(n):
                started.append(engine.start("one"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def claim() -> None:
        try:
            while True:
                finished = done.is_set()
                for c in engine.claim(["default"], f"w{threading.get_ident()}", 8):
                    claimed[c.task_id] += 1
                if finished and not _outbox(db_url):
                    return
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    starters = [threading.Thread(target=start, args=(starts // 3,)) for _ in range(3)]
    workers = [threading.Thread(target=claim) for _ in range(claimers)]
    for t in starters + workers:
        t.start()
    for t in starters:
        t.join(120)
    done.set()
    for t in workers:
        t.join(60)
    assert errors == []
    with psycopg.connect(db_url) as conn:
        states: dict[str, int] = dict(conn.execute("SELECT state, count(*) FROM task_instances GROUP BY 1").fetchall())
    assert len(started) == starts
    assert states == {"RUNNING": starts}          # none left PENDING without its dispatch
    assert len(claimed) == starts and set(claimed.values()) == {1}


def test_an_outbox_row_of_a_next_attempt_not_visible_yet_is_kept_and_claimed_later(db_url: str,
                                                                                   engine: Engine) -> None:
    # A re-queue (lease expired, or a retry) moves the same task row to attempt + 1 and
    # adds that attempt's outbox row in one two-phase transaction. Held open here: the
    # coordinator's part (the outbox row for attempt 1) committed, the worker's part (the
    # row's move from attempt 0 to 1) not yet, so the claimer still sees attempt 0
    # RUNNING. That is not a settled task: it was lost when the claim dropped the row
    # (the CI run of ecc547c, with a worker node killed between PREPARE and COMMIT
    # PREPARED, left a run's task PENDING at attempt 1 for good).
    run_id = engine.start("one")
    [first] = engine.claim(["default"], "w0", 10)
    assert first.attempt == 0
    with psycopg.connect(db_url) as requeuer:
        requeuer.execute("""UPDATE task_instances SET state = 'PENDING', attempt = 1,
                                   lease_owner = NULL, lease_expires_at = NULL
                             WHERE run_id = %s AND id = %s""", (run_id, first.task_id))
        with psycopg.connect(db_url, autocommit=True) as coordinator_part:
            coordinator_part.execute("""INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s)
                                        VALUES ('default', %s, %s, 1, 't', 30)""", (run_id, first.task_id))
        assert engine.claim(["default"], "w1", 10) == []
        assert _outbox(db_url) == [(run_id, first.task_id, 1)]       # kept, not lost
        # Kept, it is put back: a claim of one task takes the row behind it, not it again.
        other = engine.start("one")
        assert [c.run_id for c in engine.claim(["default"], "w2", 1)] == [other]
        requeuer.commit()
    deadline = time.monotonic() + 5
    claims = engine.claim(["default"], "w1", 10)
    while not claims and time.monotonic() < deadline:
        time.sleep(0.05)
        claims = engine.claim(["default"], "w1", 10)
    assert [(c.run_id, c.task_id, c.attempt) for c in claims] == [(run_id, first.task_id, 1)]
    assert _outbox(db_url) == []
    assert engine.get_run(run_id).tasks[0].state == "RUNNING"
