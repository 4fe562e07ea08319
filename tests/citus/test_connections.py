"""The coordinator's passes reuse their connections to the worker nodes.

A pass scans every shard (due timers, expired leases, child rows). With Citus's default
``citus.max_cached_conns_per_worker = 1``, each pass opened about six new backends on
each worker node and closed them at the end of the statement's transaction, most of the
pass's CPU (docs/scaling.md). ``sql/citus/V013__cached_worker_connections.sql`` sets the
cache as large as the connections a statement may use, for every session of the
database; sessions are counted on the worker nodes (``pg_stat_database.sessions``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from composer_ops import Engine
from composer_ops.db.migrate import migrate
from composer_ops.testing.citus import CitusCluster

#: What the V013 migration sets: connections a statement may use per worker node,
#: and as many kept for the session.
PER_WORKER = 1
#: The shards of the database the passes scan: the session's database has 8 (the test
#: cluster's), 2 per node at a time, too few to make a scan open more connections.
SHARDS = 32


@pytest.fixture(scope="module")
def wide_db(citus_cluster: CitusCluster) -> Iterator[str]:
    """A database of its own whose tables have ``SHARDS`` shards (the default of Citus)."""
    with citus_cluster.database(prefix="composer_wide") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER DATABASE {} SET citus.shard_count = {}").format(
                sql.Identifier(str(conn.info.dbname)), sql.Literal(SHARDS)))
        migrate(url)
        yield url


@pytest.fixture
def worker_probes(wide_db: str, citus_cluster: CitusCluster) -> Iterator[list[psycopg.Connection]]:
    """One connection per worker node, opened before what is counted."""
    name = psycopg.conninfo.conninfo_to_dict(wide_db)["dbname"]
    conns = [psycopg.connect(w.url(str(name)), autocommit=True) for w in citus_cluster.workers]
    yield conns
    for c in conns:
        c.close()


def _sessions(probes: list[psycopg.Connection], db: str) -> int:
    total = 0
    for conn in probes:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", (db,)).fetchone()
        total += int(row[0]) if row else 0
    return total


def _settled(probes: list[psycopg.Connection], db: str, timeout: float = 30.0) -> int:
    """The session count once it stops moving: a backend's count reaches the statistics
    when it exits (or, idle, within seconds)."""
    last, deadline = _sessions(probes, db), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _sessions(probes, db)
        if now == last:
            return now
        last = now
    raise AssertionError(f"worker sessions still moving after {timeout}s")


def _opened_by(db_url: str, probes: list[psycopg.Connection], passes: int) -> int:
    """Worker sessions opened by a coordinator that connects, makes ``passes`` passes
    of every loop and closes."""
    db = str(psycopg.conninfo.conninfo_to_dict(db_url)["dbname"])
    before = _settled(probes, db)
    with Engine.connect(db_url, pool_size=1, application_name="test-passes") as engine:
        coordinator = engine.coordinator()
        for _ in range(passes):
            stats = coordinator.run_once()
            assert not stats.errors
    return _settled(probes, db) - before


@pytest.mark.timeout(240)
def test_passes_after_the_first_open_no_worker_connections(wide_db: str,
                                                           worker_probes: list[psycopg.Connection]) -> None:
    with psycopg.connect(wide_db) as conn:
        shards = conn.execute("SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'task_instances'::regclass")
        assert shards.fetchone() == (SHARDS,)
    with Engine.connect(wide_db, pool_size=1) as engine:
        engine.deploy({"id": "cc", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        for _ in range(4):
            engine.start("cc")      # active tasks: the lease and timer scans have rows to read
    one = _opened_by(wide_db, worker_probes, 1)
    many = _opened_by(wide_db, worker_probes, 11)
    # The ten passes after the first may at most fill the cache (a later statement can
    # use more connections than the first did); without it each pass opened about six
    # per node, 120 on two nodes.
    assert many - one <= PER_WORKER * len(worker_probes), (one, many)


def test_migrate_sets_the_connection_cache_for_every_session(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        rows: dict[str, str] = dict(conn.execute(
            """SELECT name, setting || ' ' || source FROM pg_settings WHERE name IN
                ('citus.max_cached_conns_per_worker', 'citus.max_adaptive_executor_pool_size')""").fetchall())
    assert rows == {"citus.max_cached_conns_per_worker": f"{PER_WORKER} database",
                    "citus.max_adaptive_executor_pool_size": f"{PER_WORKER} database"}
