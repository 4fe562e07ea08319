"""Dispatch on Citus cannot lose a task.

The outbox is distributed by run ID and co-located with the runs (sql/citus/V016), so
a task and its outbox row are written on one node by one transaction that commits in
one phase: no claimer can see one without the other. The claim still drops a row whose
task is no longer PENDING (cancelled, or a stale attempt)."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.core.model import TimerDue
from composer_ops.db import autocommit
from composer_ops.engine.ids import uuid7_text
from composer_ops.errors import NotDelegated
from composer_ops.repo import citus
from composer_ops.testing.citus import CitusCluster, run_ids_on_one_shard

SPEC = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=8) as e:
        e.deploy(SPEC)
        yield e


def _outbox(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT run_id, task_id, attempt FROM task_outbox ORDER BY id").fetchall()


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


def _prepared_during(conn: psycopg.Connection[Any], event: Callable[[], Any]) -> tuple[int, Any]:
    """How many two-phase commits Citus recorded (``pg_dist_transaction`` rows, one per
    worker node a transaction prepared on) while ``event()`` ran, and its result."""
    before = [r[0] for r in conn.execute("SELECT gid FROM pg_dist_transaction").fetchall()]
    result = event()
    row = conn.execute("SELECT count(*) FROM pg_dist_transaction WHERE gid <> ALL(%s)", (before,)).fetchone()
    return (row[0] if row else -1), result


def test_a_task_and_its_outbox_row_commit_together_on_the_runs_node_in_one_phase(db_url: str,
                                                                                 engine: Engine) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        prepared, runs = _prepared_during(conn, lambda: [engine.start("one") for _ in range(10)])
        assert prepared == 0                         # no start prepared a transaction on any node
        queued = [r[0] for r in conn.execute("SELECT run_id FROM task_outbox WHERE run_id = ANY(%s)",
                                             (runs,)).fetchall()]
        placed = conn.execute("""
            SELECT r,
                   (SELECT groupid FROM pg_dist_placement
                     WHERE shardid = get_shard_id_for_distribution_column('workflow_runs', r)),
                   (SELECT groupid FROM pg_dist_placement
                     WHERE shardid = get_shard_id_for_distribution_column('task_outbox', r))
              FROM unnest(%s::text[]) AS u(r)""", (queued,)).fetchall()
    assert sorted(r for r, _, _ in placed) == sorted(runs)
    assert all(run_node == outbox_node for _, run_node, outbox_node in placed)



FLOW = {"id": "flow", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "retry": {"max_attempts": 2, "initial_backoff_s": 0}},
    {"id": "b", "type": "WAIT_FOR_EVENT", "event": "go", "depends_on": ["a"]},
    {"id": "c", "type": "TASK", "task": "t", "depends_on": ["b"]}]}


def test_failures_requeues_and_resolved_waits_commit_in_one_phase(db_url: str, engine: Engine) -> None:
    """The events whose fenced updates the event's one statement writes (repo/writes.py: failed,
    resolved, finish) prepare no transaction: each commits on its run's node alone."""
    engine.deploy(FLOW)
    prepared: dict[str, int] = {}
    with psycopg.connect(db_url, autocommit=True) as conn:

        def count(name: str, event: Callable[[], Any]) -> Any:
            prepared[name], result = _prepared_during(conn, event)
            return result

        run = engine.start("flow")
        first = engine.claim(["default"], "w1", 1)
        count("re-queue", lambda: engine.fail(first[0], "boom", retryable=True))
        again = engine.claim(["default"], "w1", 1)
        assert [(c.run_id, c.attempt) for c in again] == [(run, 1)]
        count("complete", lambda: engine.complete(again[0], {"ok": True}))
        count("resolved wait (signal)", lambda: engine.signal(run, "go", {"x": 1}))
        last = engine.claim(["default"], "w1", 1)
        assert [c.node_id for c in last] == ["c"]
        count("failure, run finished", lambda: engine.fail(last[0], "fatal", retryable=False))
        other = engine.start("flow", run_id=_on_another_node(conn, run))
        # The count itself: a write to runs on two nodes in one transaction prepares.
        count("probe", lambda: conn.execute("UPDATE workflow_runs SET updated_at = updated_at WHERE id = ANY(%s)",
                                            ([run, other],)))
    assert engine.get_run(run).status == "FAILED"
    assert prepared.pop("probe") > 0
    assert prepared == {"re-queue": 0, "complete": 0, "resolved wait (signal)": 0, "failure, run finished": 0}


def _on_another_node(conn: psycopg.Connection[Any], run: str) -> str:
    """A fresh run ID whose shard is on another node than ``run``'s."""
    node = ("SELECT groupid FROM pg_dist_placement "
            "WHERE shardid = get_shard_id_for_distribution_column('workflow_runs', %s::text)")
    mine = conn.execute(node, (run,)).fetchone()
    while True:
        candidate = uuid7_text()
        if conn.execute(node, (candidate,)).fetchone() != mine:
            return candidate


OTHERS = {"id": "others", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "lease_s": 1, "retry": {"max_attempts": 3, "initial_backoff_s": 0}},
    {"id": "nap", "type": "WAIT", "duration_s": 0, "depends_on": ["a"]},
    {"id": "b", "type": "WAIT_FOR_EVENT", "event": "go", "depends_on": ["nap"]},
    {"id": "c", "type": "TASK", "task": "t", "depends_on": ["b"]}]}


def test_the_other_events_of_a_run_commit_in_one_phase(db_url: str, engine: Engine) -> None:
    """Heartbeat, a lost lease noted, lease expiry, a timer, a buffered signal, cancel and
    retry: none prepares a transaction."""
    engine.deploy(OTHERS)
    prepared: dict[str, int] = {}
    coordinator = engine.coordinator()
    with psycopg.connect(db_url, autocommit=True) as conn:

        def count(name: str, event: Callable[[], Any]) -> Any:
            prepared[name], result = _prepared_during(conn, event)
            return result

        run = engine.start("others")
        first = engine.claim(["default"], "w1", 1)
        count("heartbeat", lambda: engine.heartbeat(first[0]))
        count("lease lost, noted", lambda: engine.lease_lost(first[0], "test"))
        conn.execute("UPDATE task_instances SET lease_expires_at = now() - interval '1 s' WHERE run_id = %s", (run,))
        stats = count("lease expiry", lambda: coordinator.run_once(["leases"]))
        assert stats.leases_expired == 1
        again = engine.claim(["default"], "w1", 1)
        engine.complete(again[0], None)
        count("signal buffered", lambda: engine.signal(run, "go", {"x": 1}))
        nap = conn.execute("SELECT id FROM task_instances WHERE run_id = %s AND node_id = 'nap'", (run,)).fetchone()
        assert nap is not None
        # The event alone (the timers loop's priority aging: the next test).
        fired = count("timer", lambda: engine.shell.handle(run, lambda now: TimerDue(task_id=nap[0], node_id="nap",
                                                                                     now=now)))
        assert not fired.stale
        assert engine.get_run(run).status == "RUNNING"
        count("cancel", lambda: engine.cancel(run))
        count("retry", lambda: engine.retry(run))
    assert prepared == dict.fromkeys(("heartbeat", "lease lost, noted", "lease expiry", "signal buffered", "timer",
                                      "cancel", "retry"), 0)


def test_priority_aging_raises_each_dispatch_in_one_phase(db_url: str, engine: Engine) -> None:
    """The timers loop's priority aging reads the outbox over every shard in autocommit,
    then raises each aged dispatch with a statement routed to its run's node: nothing
    prepares, and the raise holds no row's lock while it waits for another's."""
    runs = [engine.start("one") for _ in range(5)]
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE task_outbox SET priority = 0, available_at = now() - interval '1 hour' "
                     "WHERE run_id = ANY(%s)", (runs[:4],))
        conn.execute("UPDATE task_outbox SET priority = 5 WHERE run_id = %s", (runs[4],))
        prepared, stats = _prepared_during(conn, lambda: engine.coordinator(priority_aging_s=60).run_once(["timers"]))
        priorities = [r[0] for r in conn.execute("SELECT priority FROM task_outbox ORDER BY run_id").fetchall()]
    assert stats.priorities_raised == 4
    assert priorities == [5] * 5
    assert prepared == 0


def test_a_node_claim_takes_no_more_than_its_limit_from_a_shard_analyzed_empty(db_url: str,
                                                                               engine: Engine) -> None:
    """The node claim's pick ran as ``DELETE ... WHERE (run_id, id) IN (SELECT ... LIMIT n
    FOR UPDATE SKIP LOCKED)``. A shard whose rows were all claimed and then vacuumed (an
    autovacuum does it) has statistics of one page and no rows: the planner, expecting one
    row, ran the pick as a nested-loop semi join that repeated the LIMIT subquery for every
    outbox row, each run skipping the rows the statement had deleted. A claim of one took
    every ready row of the shard (2 of 4 in the flaky-test finder's run of 945be0f)."""
    ids = run_ids_on_one_shard(db_url, 8)
    for run_id in ids[:4]:
        engine.start("one", run_id=run_id)
    assert len(engine.claim(["default"], "w0", 4)) == 4            # the shard's rows claimed: empty
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ANALYZE task_outbox")                        # the shard: one page, no rows
    runs = [engine.start("one", run_id=run_id) for run_id in ids[4:]]
    claimed = engine.claim(["default"], "w1", 1)
    assert [c.run_id for c in claimed] == runs[:1]
    assert sorted(r[0] for r in _outbox(db_url)) == sorted(runs[1:])


def test_a_node_claim_citus_does_not_delegate_fails_instead_of_claiming_nothing(db_url: str,
                                                                               engine: Engine) -> None:
    """In a transaction block Citus does not delegate a distributed function: the call ran
    on the coordinator, whose group holds no outbox shard, and claimed nothing though
    tasks were ready on the key's node."""
    runs = {engine.start("one") for _ in range(6)}
    with engine.pool.connection() as conn, autocommit(conn):
        for key in engine.stream_keys(conn):
            with pytest.raises(NotDelegated, match=r"composer_claim_node\('stream-\d+'\) ran on node group 0"), \
                    conn.transaction():
                citus.claim_on_node(conn, key, ["default"], "w", 10, None, claim_id=uuid7_text())
    assert {c.run_id for c in engine.claim(["default"], "w", 10)} == runs        # nothing was taken


def test_a_claim_whose_node_call_is_not_delegated_logs_it_and_claims_through_the_coordinator(
        db_url: str, engine: Engine, citus_cluster: CitusCluster, caplog: pytest.LogCaptureFixture) -> None:
    """A worker node whose metadata is not synced (being added, or an operator's
    stop_metadata_sync_to_node) is not delegated to: its node call raises, the engine logs
    it once and its ready tasks are claimed by the coordinator's claim, over every shard."""
    runs = {engine.start("one") for _ in range(8)}
    worker = citus_cluster.workers[-1]
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SELECT stop_metadata_sync_to_node('127.0.0.1', %s)", (worker.port,))
        try:
            with caplog.at_level(logging.ERROR, logger="composer_ops.engine.engine"):
                claimed = {c.run_id for c in engine.claim(["default"], "w", 4)}
                claimed |= {c.run_id for c in engine.claim(["default"], "w", 10)}
        finally:
            conn.execute("SELECT start_metadata_sync_to_node('127.0.0.1', %s)", (worker.port,))
    assert claimed == runs
    assert _outbox(db_url) == []
    logged = [r for r in caplog.records if "not delegated" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]


def test_a_report_makes_no_claim_on_citus(engine: Engine) -> None:
    """On Citus a report's ``claim_next`` is not made (the claim there is a transaction
    of its own, node by node): ``Outcome.claimed`` is None and the ready task stays
    ready for the claim loop."""
    engine.start("one")
    (first,) = engine.claim(["default"], "w1", 1)
    ready = engine.start("one")
    outcome = engine.complete(first, None, claim_next=engine.next_claim(["default"], "w1", 1))
    assert outcome.applied and outcome.claimed is None
    assert [c.run_id for c in engine.claim(["default"], "w2", 1)] == [ready]
