"""Partition upkeep behind a long reader: the engine keeps starting and signalling
runs, and the months are still created; partitions come out as they always did."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.repo import partitions
from tests.integration.helpers import CoordinatorClock

SPEC = {"id": "lk", "nodes": [{"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
                              {"id": "a", "type": "TASK", "task": "t", "depends_on": ["w"]}]}


@pytest.fixture
def engine(engine: Engine) -> Engine:
    engine.deploy(SPEC)
    return engine


def _months(conn: psycopg.Connection[Any], first: int, last: int) -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT to_char(date_trunc('month', now() AT TIME ZONE 'UTC') + make_interval(months => i), 'YYYYMM') "
        "FROM generate_series(%s::int, %s::int) i", (first, last))]


def _drop_months(db_url: str, months: list[str]) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        for month in months:
            conn.execute(f"DROP TABLE workflow_events_p{month}")
            conn.execute(f"DROP TABLE task_instances_p{month}")
            conn.execute(f"ALTER TABLE workflow_runs DETACH PARTITION workflow_runs_p{month}")
            conn.execute(f"DROP TABLE workflow_runs_p{month}")


def _timed(fn: Any, out: dict[str, float], key: str) -> threading.Thread:
    def run() -> None:
        began = time.monotonic()
        fn()
        out[key] = time.monotonic() - began
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_upkeep_behind_a_long_reader_stalls_neither_starts_nor_signals(engine: Engine, db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        new = _months(conn, 2, 3)
    _drop_months(db_url, new)
    waiting = engine.start("lk")
    reader = psycopg.connect(db_url)
    reader.execute("SELECT count(*) FROM task_instances")          # an analytics query, left open
    took: dict[str, float] = {}
    try:
        upkeep = _timed(lambda: engine.coordinator(months_ahead=3).run_once(["partitions"]), took, "upkeep")
        time.sleep(0.3)              # upkeep is now at its DDL (or waiting for its lock)
        calls = [_timed(lambda: engine.start("lk"), took, "start"),
                 _timed(lambda: engine.signal(waiting, "go"), took, "signal")]
        for thread in calls:
            thread.join(30)
        upkeep.join(30)
        stalled = {k for k in ("start", "signal", "upkeep") if k not in took}
    finally:
        reader.rollback()            # let anything still queued through before asserting
        reader.close()
    assert not stalled, f"{sorted(stalled)} still waiting after 30 s behind a reader of task_instances"
    assert took["start"] < 5 and took["signal"] < 5, took
    print(f"behind a held reader: start {took['start']:.3f}s, signal {took['signal']:.3f}s, "
          f"upkeep {took['upkeep']:.3f}s")
    with psycopg.connect(db_url) as conn:
        have = {(p.table, p.month) for p in partitions.list_partitions(conn)}
    assert {(t, m) for t in partitions.RUN_TABLES for m in new} <= have


def test_a_writer_bounds_upkeep_by_its_lock_timeout_and_upkeep_retries_later(
        engine: Engine, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attaching waits for writers of workflow_runs (the foreign keys): bounded by the
    lock timeout, so a start queued behind it waits at most that long; the next pass
    after the backoff creates the months."""
    with psycopg.connect(db_url) as conn:
        new = _months(conn, 2, 2)
    _drop_months(db_url, new)
    writer = psycopg.connect(db_url)
    writer.execute("UPDATE workflow_runs SET updated_at = updated_at WHERE false")   # ROW EXCLUSIVE, held
    clock = CoordinatorClock(monkeypatch)
    coordinator = engine.coordinator(months_ahead=2, upkeep_lock_timeout_s=0.3)
    try:
        began = time.monotonic()
        stats = coordinator.run_once(["partitions"])
        waited = time.monotonic() - began
    finally:
        writer.rollback()
        writer.close()
    assert stats.errors and "lock timeout" in stats.errors[0], stats
    assert waited < 10, waited                                      # unbounded, it would wait for ever
    assert coordinator.run_once(["partitions"]).errors == []        # still backing off: not tried yet
    clock.advance(1.1)
    assert coordinator.run_once(["partitions"]).partitions_created == 3


def test_attached_partitions_are_shaped_like_created_ones(db_url: str) -> None:
    """What CREATE TABLE ... PARTITION OF produced, ATTACH produces: same columns,
    collations, defaults, NOT NULLs, indexes, constraints and storage options."""
    shape = """
        SELECT 'col', a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull::text,
               coalesce(co.collname, ''), coalesce(pg_get_expr(d.adbin, d.adrelid), '')
          FROM pg_attribute a LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE a.attrelid = %(rel)s::regclass AND a.attnum > 0 AND NOT a.attisdropped
        UNION ALL
        SELECT 'idx', regexp_replace(pg_get_indexdef(i.indexrelid), '_p\\d{6}', '_pM', 'g'), '', '', '', ''
          FROM pg_index i WHERE i.indrelid = %(rel)s::regclass
        UNION ALL
        SELECT 'con', c.contype::text, pg_get_constraintdef(c.oid), '', '', ''
          FROM pg_constraint c WHERE c.conrelid = %(rel)s::regclass
        UNION ALL
        SELECT 'opt', coalesce(array_to_string(c.reloptions, ','), ''), c.relpersistence::text, '', '', ''
          FROM pg_class c WHERE c.oid = %(rel)s::regclass
        ORDER BY 1, 2, 3"""
    with psycopg.connect(db_url, autocommit=True) as conn:
        for table in partitions.RUN_TABLES:
            conn.execute(f"CREATE TABLE {table}_p204001 PARTITION OF {table} FOR VALUES "
                         "FROM (composer_uuid7_bound('2040-01-01Z')) TO (composer_uuid7_bound('2040-02-01Z'))"
                         + (" WITH (fillfactor = 80)" if table == "task_instances" else ""))
        conn.execute("SELECT composer_ensure_partitions_from('2041-01-01', 0)")
        for table in partitions.RUN_TABLES:
            created = conn.execute(shape, {"rel": f"{table}_p204001"}).fetchall()
            attached = conn.execute(shape, {"rel": f"{table}_p204101"}).fetchall()
            assert attached == created, table
