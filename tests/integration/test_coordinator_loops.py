"""The timer loop and the lease sweeper make progress past rows they cannot change:
soft-deleted runs are not theirs to touch, and a row that fails (stale for ever,
odd data, an unexpected exception) is backed off instead of blocking the head of the
queue, and never stops the rest of the batch."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from tests.integration.helpers import CoordinatorClock

TIMER = {"id": "tm", "nodes": [{"id": "z", "type": "WAIT", "duration_s": 3600},
                               {"id": "b", "type": "TASK", "task": "t", "depends_on": ["z"]}]}
LEASED = {"id": "ls", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "lq",
                                 "retry": {"max_attempts": 5, "initial_backoff_s": 0}}]}


@pytest.fixture
def engine(engine: Engine) -> Engine:
    engine.deploy(TIMER)
    engine.deploy(LEASED)
    return engine


def _sql(db_url: str, query: str, params: tuple[object, ...] = ()) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(query, params)


def _due_timers(engine: Engine, db_url: str, n: int, workflow: str = "tm", input: Any = None) -> list[str]:
    """n runs whose WAIT is due, the first one the most overdue."""
    run_ids = [engine.start(workflow, input=input) for _ in range(n)]
    for i, run_id in enumerate(run_ids):
        _sql(db_url, "UPDATE task_instances SET wake_at = now() - make_interval(mins => %s) "
                     "WHERE run_id = %s AND state = 'WAITING'", (100 - i, run_id))
    return run_ids


def _expired_leases(engine: Engine, db_url: str, n: int, workflow: str = "ls", queue: str = "lq",
                    input: Any = None) -> list[str]:
    run_ids = [engine.start(workflow, input=input) for _ in range(n)]
    for claim in engine.claim([queue], "w", n):
        _sql(db_url, "UPDATE task_instances SET lease_expires_at = now() - make_interval(mins => %s) "
                     "WHERE run_id = %s AND state = 'RUNNING'", (100 - run_ids.index(claim.run_id), claim.run_id))
    return run_ids


def _state(engine: Engine, run_id: str, node: str) -> tuple[str, int]:
    task = next(t for t in engine.get_run(run_id).tasks if t.node_id == node)
    return task.state, task.attempt


def _soft_delete(db_url: str, run_ids: list[str]) -> None:
    _sql(db_url, "UPDATE workflow_runs SET deleted_at = now() WHERE id = ANY(%s)", (run_ids,))


def test_timers_of_soft_deleted_runs_do_not_block_the_others(engine: Engine, db_url: str) -> None:
    deleted_a, deleted_b, live = _due_timers(engine, db_url, 3)
    _soft_delete(db_url, [deleted_a, deleted_b])
    coordinator = engine.coordinator(batch=2)
    stats = coordinator.run_once(["timers"])
    assert stats.errors == [] and stats.timers_fired == 1, stats
    assert _state(engine, live, "z") == ("COMPLETED", 0)
    with psycopg.connect(db_url) as conn:
        left = conn.execute("SELECT count(*) FROM task_instances WHERE run_id = ANY(%s) AND state = 'WAITING'",
                            ([deleted_a, deleted_b],)).fetchone()
    assert left == (2,)                          # a deleted run is not the loop's to change


def test_leases_of_soft_deleted_runs_do_not_block_the_others(engine: Engine, db_url: str) -> None:
    deleted_a, deleted_b, live = _expired_leases(engine, db_url, 3)
    _soft_delete(db_url, [deleted_a, deleted_b])
    stats = engine.coordinator(batch=2).run_once(["leases"])
    assert stats.errors == [] and stats.leases_expired == 1, stats
    assert _state(engine, live, "a") == ("PENDING", 1)


def test_a_row_that_fails_for_ever_is_backed_off_and_the_queue_moves(engine: Engine, db_url: str) -> None:
    """A WAITING task for a node its definition does not have is stale on every try;
    with a batch of one, unless it is backed off, it is selected first on every pass."""
    ghost, live = _due_timers(engine, db_url, 2)
    _sql(db_url, "UPDATE task_instances SET node_id = 'ghost' WHERE run_id = %s AND node_id = 'z'", (ghost,))
    coordinator = engine.coordinator(batch=1)
    first = coordinator.run_once(["timers"])
    second = coordinator.run_once(["timers"])
    assert (first.stale, first.timers_fired, second.timers_fired) == (1, 0, 1), (first, second)
    assert _state(engine, live, "z") == ("COMPLETED", 0)
    third = coordinator.run_once(["timers"])         # the ghost is still backing off: nothing to do
    assert (third.stale, third.timers_fired, third.errors) == (0, 0, []), third


def test_an_unexpected_exception_does_not_stop_the_batch(engine: Engine, db_url: str) -> None:
    """A run whose stored context is not an object makes the shell raise a plain
    Python error (odd data) when a decision reads it (a node input from the run's input,
    a concurrency key from it); the rest of the batch is still handled, and the bad row
    is reported once, then backed off."""
    engine.deploy({"id": "tm_in", "nodes": [{"id": "z", "type": "WAIT", "duration_s": 3600},
                                            {"id": "b", "type": "TASK", "task": "t", "depends_on": ["z"],
                                             "input": {"x": "$.input.x"}}]})
    engine.deploy({"id": "ls_key", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "lk",
                                              "retry": {"max_attempts": 5, "initial_backoff_s": 0},
                                              "concurrency": {"key": "$.input.x", "limit": 100}}]})
    broken, live = _due_timers(engine, db_url, 2, "tm_in", {"x": 1})
    _sql(db_url, "UPDATE workflow_runs SET context_json = '\"not an object\"' WHERE id = %s", (broken,))
    coordinator = engine.coordinator(batch=10)
    stats = coordinator.run_once(["timers"])
    assert stats.timers_fired == 1 and len(stats.errors) == 1 and broken in stats.errors[0], stats
    assert _state(engine, live, "z") == ("COMPLETED", 0)
    assert coordinator.run_once(["timers"]).errors == []
    expired_broken, expired_live = _expired_leases(engine, db_url, 2, "ls_key", "lk", {"x": 1})
    _sql(db_url, "UPDATE workflow_runs SET context_json = '\"not an object\"' WHERE id = %s", (expired_broken,))
    stats = coordinator.run_once(["leases"])
    assert stats.leases_expired == 1 and len(stats.errors) == 1, stats
    assert _state(engine, expired_live, "a") == ("PENDING", 1)


@pytest.mark.parametrize("loop", ["leases", "timers"])
def test_a_run_whose_lock_is_held_elsewhere_does_not_stall_the_pass(engine: Engine, db_url: str, loop: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Another transaction holds one run's row lock (an operator's FOR UPDATE left open;
    on Citus, a transaction left prepared on a worker node that crashed, until Citus's
    recovery resolves it, up to a minute). The pass gives up on that run after the
    coordinator's ``event_lock_wait_s``, backs it off, and handles the rest: it used to
    wait for the lock, and every expired lease and due timer behind it waited too."""
    held, live = (_expired_leases if loop == "leases" else _due_timers)(engine, db_url, 2)   # held is first
    node, done = ("a", ("PENDING", 1)) if loop == "leases" else ("z", ("COMPLETED", 0))
    before = _state(engine, held, node)
    clock = CoordinatorClock(monkeypatch)
    coordinator = engine.coordinator(batch=10, event_lock_wait_s=0.5)
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT 1 FROM workflow_runs WHERE id = %s FOR UPDATE", (held,))
        began = time.monotonic()
        stats = coordinator.run_once([loop])
        took = time.monotonic() - began
        assert _state(engine, live, node) == done
        assert _state(engine, held, node) == before
        assert (stats.busy, stats.errors) == (1, []), stats
        assert took < 30, took                                   # waiting for the lock would never end
        assert coordinator.run_once([loop]).busy == 0          # backed off: not waited for again at once
    clock.advance(1.1)                                           # the first backoff is 1 s
    again = coordinator.run_once([loop])
    assert (again.busy, again.errors) == (0, []), again
    assert _state(engine, held, node) == done


def test_a_locked_run_is_waited_for_once_a_pass_not_once_per_candidate(engine: Engine, db_url: str) -> None:
    """A fan-out whose worker died has several expired leases in one run; with its lock
    held elsewhere, the pass waits for it once, then backs the run's other candidates
    off without waiting (each waiting in turn made a pass of a batch of 100 last up to
    100 times the wait)."""
    engine.deploy({"id": "two", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "lq"},
                                          {"id": "b", "type": "TASK", "task": "t", "queue": "lq"}]})
    run_id = engine.start("two")
    assert len(engine.claim(["lq"], "w", 2)) == 2
    _sql(db_url, "UPDATE task_instances SET lease_expires_at = now() - interval '1 minute' WHERE run_id = %s",
         (run_id,))
    # A wait long enough that once and twice differ by more than a loaded machine adds.
    coordinator = engine.coordinator(batch=10, event_lock_wait_s=5.0)
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT 1 FROM workflow_runs WHERE id = %s FOR UPDATE", (run_id,))
        began = time.monotonic()
        stats = coordinator.run_once(["leases"])
        took = time.monotonic() - began
    assert (stats.busy, stats.leases_expired, stats.errors) == (2, 0, []), stats
    assert 5.0 <= took < 10.0, took                        # once, with 5 s for the rest of the pass


def test_coordinator_once_says_how_many_it_backed_off_behind_a_locked_run(
        engine: Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    [held] = _expired_leases(engine, db_url, 1)
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT 1 FROM workflow_runs WHERE id = %s FOR UPDATE", (held,))
        code = main(["coordinator", "--once", "--event-lock-wait", "0.3", "--database-url", db_url])
    out = capsys.readouterr().out
    assert code == 0 and "leases expired 0" in out and out.rstrip().endswith("backed off behind a locked run 1"), out
