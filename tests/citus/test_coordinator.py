"""The coordinator's pass on Citus does not wait behind a run whose lock a transaction
left prepared on a worker node holds.

A worker node killed between a two-phase commit's PREPARE and its COMMIT PREPARED
comes back holding that transaction prepared, with its row locks, until Citus's
recovery resolves it (``citus.recover_2pc_interval``, a minute by default). The lease
sweeper used to wait for such a run's lock, and every expired lease behind it waited
too: the Citus chaos run of the project's CI measured re-queues 38 s after a worker
kill (median), against 3 s without the node kill. Here the prepared transaction is
made directly on the run's worker node."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from composer_ops import Engine
from composer_ops.testing.citus import CitusCluster

SPEC = {"id": "ls", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "lq",
                               "retry": {"max_attempts": 5, "initial_backoff_s": 0}}]}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=4) as e:
        e.deploy(SPEC)
        yield e


def _node_of(db_url: str, cluster: CitusCluster, run_id: str) -> tuple[str, int]:
    """The worker node's URL and the shard ID of the run's workflow_runs row."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute("""
            SELECT s.shardid, n.nodeport
              FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid)
              JOIN pg_dist_node n ON n.groupid = p.groupid
             WHERE s.shardid = get_shard_id_for_distribution_column('workflow_runs', %s::text)""", (run_id,)).fetchone()
        name = conn.execute("SELECT current_database()").fetchone()
    assert row is not None and name is not None
    shard, port = int(row[0]), int(row[1])
    node = next(w for w in cluster.workers if w.port == port)
    return node.url(str(name[0])), shard


@pytest.mark.timeout(120)
def test_a_run_locked_by_a_prepared_transaction_does_not_stall_the_lease_sweeper(
        db_url: str, citus_cluster: CitusCluster, engine: Engine) -> None:
    held, live = engine.start("ls"), engine.start("ls")
    claims = {c.run_id: c for c in engine.claim(["lq"], "w", 2)}
    assert set(claims) == {held, live}
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE task_instances SET lease_expires_at = now() - make_interval(mins => 10) "
                     "WHERE run_id = %s", (held,))
        conn.execute("UPDATE task_instances SET lease_expires_at = now() - make_interval(mins => 5) "
                     "WHERE run_id = %s", (live,))
    node_url, shard = _node_of(db_url, citus_cluster, held)
    gid = f"composer_test_{held}"
    with psycopg.connect(node_url, autocommit=True) as node:
        node.execute("BEGIN")
        node.execute(sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR UPDATE").format(
            sql.Identifier(f"workflow_runs_{shard}")), (held,))
        node.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        try:
            coordinator = engine.coordinator(batch=10, event_lock_wait_s=0.5)
            began = time.monotonic()
            stats = coordinator.run_once(["leases"])
            took = time.monotonic() - began
            assert (stats.leases_expired, stats.busy, stats.errors) == (1, 1, []), stats
            assert took < 10, took
            by_run = {r: engine.get_run(r).tasks[0] for r in (held, live)}
            assert (by_run[live].state, by_run[live].attempt) == ("PENDING", 1)
            assert (by_run[held].state, by_run[held].attempt) == ("RUNNING", 0)
        finally:
            node.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    time.sleep(1.1)                                   # the first backoff is 1 s
    again = coordinator.run_once(["leases"])
    assert (again.leases_expired, again.busy, again.errors) == (1, 0, []), again
    task = engine.get_run(held).tasks[0]
    assert (task.state, task.attempt) == ("PENDING", 1)
