"""Heartbeats are HOT updates, and the background loops still read partial indexes.

HOT ratios come from pg_stat_user_tables on the task_instances partitions. The
session that made the updates calls pg_stat_force_next_flush() (PostgreSQL 15+), so
its counters are published before the next statement returns; the other sessions
(the Engine's pool) publish theirs when they disconnect, which we wait for.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import date
from typing import Any

import psycopg
import pytest

# The benchmark EXPLAINs the same statements on the same seed, and puts back the seed's
# layout of task_instances (its lease index, fillfactor 100) on the current schema.
from bench.hot import SEED, StatementCapture, _v004_layout
from composer_ops import Engine
from composer_ops.core.model import TaskRef
from composer_ops.repo import clock, signals, tasks
from composer_ops.repo.rows import Claim

SPEC = {"id": "hb", "nodes": [{"id": "work", "type": "TASK", "task": "noop", "lease_s": 300}]}
TASKS = 120
ROUNDS = 3


def _task_stats(url: str) -> tuple[int, int, int]:
    """(inserts, updates, HOT updates) summed over the task_instances partitions."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("""
            SELECT COALESCE(sum(n_tup_ins), 0), COALESCE(sum(n_tup_upd), 0), COALESCE(sum(n_tup_hot_upd), 0)
              FROM pg_stat_user_tables s JOIN pg_inherits i ON i.inhrelid = s.relid
             WHERE i.inhparent = 'task_instances'::regclass""").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _wait_stats(url: str, *, inserts: int, updates: int, timeout: float = 30.0) -> tuple[int, int, int]:
    deadline = time.monotonic() + timeout
    while True:
        found = _task_stats(url)
        if found[0] >= inserts and found[1] >= updates:
            return found
        assert time.monotonic() < deadline, f"statistics never showed {inserts} inserts / {updates} updates: {found}"
        time.sleep(0.2)


def _running_tasks(url: str) -> list[Claim]:
    """TASKS runs started and claimed through the engine (then its sessions close,
    which publishes their statistics)."""
    with Engine.connect(url, pool_size=2) as engine:
        engine.deploy(SPEC)
        for _ in range(TASKS):
            engine.start("hb")
        claims = engine.claim(["default"], "test-worker", TASKS)
    assert len(claims) == TASKS
    _wait_stats(url, inserts=TASKS, updates=TASKS)
    return claims


def _heartbeat_hot_ratio(url: str) -> float:
    claims = _running_tasks(url)
    _, upd0, hot0 = _task_stats(url)
    with psycopg.connect(url) as conn:
        for _ in range(ROUNDS):
            for c in claims:
                ref = TaskRef(task_id=c.task_id, run_id=c.run_id, node_id=c.node_id, attempt=c.attempt)
                assert tasks.heartbeat(conn, ref, c.lease_owner, c.lease_s) is not None
                conn.commit()
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.commit()
    _, upd1, hot1 = _wait_stats(url, inserts=0, updates=upd0 + TASKS * ROUNDS)
    assert upd1 - upd0 == TASKS * ROUNDS
    return (hot1 - hot0) / (upd1 - upd0)


def test_heartbeats_are_hot(db_url: str) -> None:
    assert _heartbeat_hot_ratio(db_url) >= 0.9


def test_with_the_seeds_lease_index_no_heartbeat_was_hot(db_url: str) -> None:
    # The seed's lease index contains lease_expires_at, the column a heartbeat changes.
    with psycopg.connect(db_url, autocommit=True) as conn:
        _v004_layout(conn)
    assert _heartbeat_hot_ratio(db_url) == 0.0


def _fillfactors(conn: Any) -> dict[str, str | None]:
    rows = conn.execute("""
        SELECT c.relname, (SELECT option_value FROM pg_options_to_table(c.reloptions)
                            WHERE option_name = 'fillfactor')
          FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent IN ('task_instances'::regclass, 'workflow_runs'::regclass)""").fetchall()
    return {name: ff for name, ff in rows}


def test_task_partitions_old_and_new_leave_room_for_hot_updates(conn: Any) -> None:
    conn.execute("SELECT composer_ensure_partitions_from(%s, 1)", (date(2031, 5, 1),))
    found = _fillfactors(conn)
    assert {"task_instances_p203105", "task_instances_p203106", "workflow_runs_p203105"} <= set(found)
    for name, fillfactor in found.items():
        assert fillfactor == ("80" if name.startswith("task_instances_") else None), name


# -- the background loops' queries still use the partial indexes ----------------------------


@pytest.fixture
def seeded(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """50,000 tasks of 5,000 runs; 1 run in 20 still active (250 RUNNING, 750 PENDING,
    250 WAITING tasks): the shape of a live system, where finished work dominates."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        with Engine.connect(db_url, pool_size=1) as engine:
            engine.deploy(SPEC)
        conn.execute(SEED, {"runs": 5000, "workflow": SPEC["id"], "owners": 1})
        conn.execute("ANALYZE workflow_runs")
        conn.execute("ANALYZE task_instances")
        yield conn


def _scans(conn: Any, query: str, params: Any) -> list[tuple[str, str, str | None]]:
    """(node type, relation, parent index) of every scan in the plan of a non-empty partition."""
    plan = conn.execute("EXPLAIN (FORMAT JSON) " + query, params).fetchone()[0][0]["Plan"]
    found: list[tuple[str, str, str | None]] = []

    def walk(node: dict[str, Any], relation: str | None = None) -> None:
        rel = node.get("Relation Name", relation)
        if "Scan" in node["Node Type"] and rel is not None:
            index = node.get("Index Name")
            parent = None
            if index:
                row = conn.execute("SELECT inhparent::regclass::text FROM pg_inherits WHERE inhrelid = %s::regclass",
                                   (index,)).fetchone()
                parent = row[0] if row else index
            tuples = conn.execute("SELECT reltuples FROM pg_class WHERE relname = %s", (rel,)).fetchone()[0]
            if tuples > 0:
                found.append((node["Node Type"], rel, parent))
        for child in node.get("Plans", []):
            walk(child, rel if node["Node Type"].startswith("Bitmap Heap") else None)

    walk(plan)
    return found


def test_lease_sweeper_reads_the_running_partial_index(seeded: Any) -> None:
    capture = StatementCapture()
    tasks.expired_leases(capture.as_connection(), 100, now=clock.now(seeded))
    (query, params), = capture.statements
    scans = _scans(seeded, query, params)
    assert scans, "the plan scans no populated partition"
    assert all(t != "Seq Scan" for t, _, _ in scans), scans
    assert {p for _, r, p in scans if p and r.startswith("task_instances")} <= {
        "idx_task_instances_running", "idx_task_instances_run_active"}, scans
    # the run of each candidate (deleted? still active?) is one primary-key lookup
    assert {p for _, r, p in scans if p and r.startswith("workflow_runs")} <= {"workflow_runs_pkey"}, scans
    # One instant for both: the seed's leases lapse over time, and a loaded machine may
    # take seconds between two statements' now().
    now = clock.now(seeded)
    expired = tasks.expired_leases(seeded, 1000, now=now)
    expected = seeded.execute(
        "SELECT count(*) FROM task_instances WHERE state = 'RUNNING' AND lease_expires_at <= %s", (now,)).fetchone()[0]
    assert len(expired) == expected > 0
    assert [e.lease_owner for e in expired] == ["worker-0"] * expected


def test_timer_loop_reads_the_wake_partial_index(seeded: Any) -> None:
    capture = StatementCapture()
    signals.due_waits(capture.as_connection(), 100, now=clock.now(seeded))
    (query, params), = capture.statements
    scans = _scans(seeded, query, params)
    assert scans and all(t != "Seq Scan" for t, _, _ in scans), scans
    assert {p for _, r, p in scans if p and r.startswith("task_instances")} == {"idx_task_instances_wake"}, scans
    assert {p for _, r, p in scans if p and r.startswith("workflow_runs")} <= {"workflow_runs_pkey"}, scans
