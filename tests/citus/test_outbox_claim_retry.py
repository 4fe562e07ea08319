"""On Citus too, a claim retried while its first attempt's transaction is still open
waits for it, then returns the tasks it took (the claim's advisory lock is the first
statement of its transaction, on the coordinator)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.engine.requests import Request
from composer_ops.repo import citus
from composer_ops.repo.rows import Claim
from composer_ops.testing.processes import wait_for
from tests.integration.helpers import claim_ask


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=4) as e:
        e.deploy({"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        yield e


def test_a_retry_waits_for_its_first_attempt_and_returns_what_it_took(db_url: str, engine: Engine) -> None:
    run_id = engine.start("one")
    with psycopg.connect(db_url) as first:            # the first attempt, its transaction left open
        assert [c.run_id for c in citus.claim(first, ["default"], "w1", 1, claim_id="claim-C")] == [run_id]
        result: list[list[Claim]] = []
        retry = threading.Thread(target=lambda: result.append(
            engine._claim(claim_ask(["default"], "w1", 1, None, "claim-C"), Request(tries=1))), daemon=True)
        retry.start()

        def waiting() -> bool:
            with psycopg.connect(db_url, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                                   ).fetchone()
            return bool(row and row[0])

        wait_for(lambda: not retry.is_alive() or waiting(), timeout=60,
                 what="the retry to return or to wait for the first attempt")
        assert retry.is_alive(), f"the retry returned {result!r} while its first attempt was still open"
        first.commit()
    retry.join(60)
    assert [[(c.run_id, c.attempt, c.lease_owner) for c in r] for r in result] == [[(run_id, 0, "w1")]]


def _node_claim(db_url: str, engine: Engine, run_id: str, claim_id: str) -> list[Claim]:
    """The first attempt of a claim as the engine sends it on Citus: one delegated call
    to the node holding ``run_id``'s shard, in autocommit."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        node = conn.execute("SELECT p.groupid FROM pg_dist_placement p "
                            "WHERE p.shardid = get_shard_id_for_distribution_column('task_outbox', %s::text)",
                            (run_id,)).fetchone()
        keys = citus.stream_keys(conn)
        key = next(k for k in keys if conn.execute(
            "SELECT p.groupid FROM pg_dist_placement p "
            "WHERE p.shardid = get_shard_id_for_distribution_column('task_outbox', %s::text)", (k,)).fetchone() == node)
        return citus.claim_on_node(conn, key, ["default"], "w1", 1, None, claim_id=claim_id)[0]


def test_a_retry_waits_for_its_first_attempt_on_the_node(db_url: str, engine: Engine) -> None:
    """The first attempt's delegated claim is held on its node (a row lock on the task
    it is claiming) when the retry arrives: the retry waits for it on that node, then
    returns the task it took, rather than claiming under a new ID meanwhile."""
    run_id = engine.start("one")
    first: list[list[Claim]] = []
    with psycopg.connect(db_url) as blocker:
        blocker.execute("SELECT 1 FROM task_instances WHERE run_id = %s FOR UPDATE", (run_id,))
        attempt = threading.Thread(target=lambda: first.append(_node_claim(db_url, engine, run_id, "claim-N")),
                                   daemon=True)
        attempt.start()

        def blocked() -> bool:
            with psycopg.connect(db_url, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FROM run_command_on_workers($$SELECT count(*) FROM pg_locks "
                                   "WHERE locktype = 'transactionid' AND NOT granted$$) "
                                   "WHERE result::int > 0").fetchone()
            return bool(row and row[0])

        wait_for(blocked, timeout=60, what="the first attempt to wait for the task's row lock on its node")
        result: list[list[Claim]] = []
        retry = threading.Thread(target=lambda: result.append(
            engine._claim(claim_ask(["default"], "w1", 1, None, "claim-N"), Request(tries=1))), daemon=True)
        retry.start()
        retry.join(5)            # a retry that does not wait returns meanwhile
        blocker.rollback()
    attempt.join(60)
    retry.join(60)
    assert [[(c.run_id, c.attempt) for c in r] for r in first] == [[(run_id, 0)]]
    assert [[(c.run_id, c.attempt, c.lease_owner) for c in r] for r in result] == [[(run_id, 0, "w1")]]


def test_a_first_attempt_arriving_after_its_retry_claims_nothing(db_url: str, engine: Engine) -> None:
    """The retry fences its claim ID on every node: the first attempt's delegated call,
    reaching a node only after the retry, takes no task there."""
    runs = [engine.start("one") for _ in range(4)]
    claimed = engine._claim(claim_ask(["default"], "w1", 1, None, "claim-F"), Request(tries=1))
    assert len(claimed) == 1
    for run_id in runs:
        assert _node_claim(db_url, engine, run_id, "claim-F") == []
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM task_outbox").fetchone()
    assert row is not None and row[0] == 3
