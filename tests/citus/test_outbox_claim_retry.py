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
            engine._claim(["default"], "w1", 1, None, Request(id="claim-C", tries=1))), daemon=True)
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
