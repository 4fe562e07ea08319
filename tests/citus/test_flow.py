"""Flow control on Citus (composer_ops/repo/citus.py's claim, composer_ops/repo/citus_flow.py):
the single-server tests that apply, racing claimers, and one test per interleaving of a
slot on the coordinator with its task on a worker node (the module docstring of
citus_flow lists them)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.engine.ids import uuid7_text
from composer_ops.engine.requests import Request
from composer_ops.repo import citus, citus_flow
from composer_ops.repo.rows import Claim
from composer_ops.testing.citus import run_ids_on_one_shard
from composer_ops.testing.processes import wait_for
from tests.integration.helpers import claim_ask
from tests.integration.test_flow_races import (  # noqa: F401
    test_a_concurrency_key_is_never_over_its_limit_with_eight_workers_killed,
    test_a_rate_limit_holds_within_ten_percent_over_twenty_seconds,
)
from tests.integration.test_queues import (  # noqa: F401
    test_a_concurrency_key_at_its_limit_does_not_hold_up_other_keys,
    test_a_limit_takes_over_the_place_of_an_earlier_attempt_not_yet_freed,
    test_a_paused_queue_claims_nothing_keeps_its_tasks_and_resumes,
    test_a_queue_named_twice_in_a_claim_is_counted_once,
    test_a_rate_limit_gives_its_burst_then_refills_by_the_database_clock,
    test_keys_at_their_limit_and_rate_limited_waits_are_reported,
)

PERCUST: dict[str, Any] = {"id": "percust", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "k",
                                       "input": {"customer": "$.input.customer"},
                                       "concurrency": {"key": "$.input.customer", "limit": 1}}]}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """tests/integration/test_queues.py's definitions: queue q at three priorities, queue r."""
    with Engine.connect(db_url, pool_size=4) as e:
        for name, priority in (("low", 0), ("high", 5), ("mid", 2)):
            e.deploy({"id": name, "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "q",
                                             **({"priority": priority} if priority else {})}]})
        e.deploy({"id": "other", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "r"}]})
        yield e


def _sql(url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(query, params).fetchall()


def _slots(url: str) -> list[tuple[Any, ...]]:
    return _sql(url, "SELECT key, count(*) FROM flow_slots GROUP BY key ORDER BY key")


def _task(url: str, run_id: str) -> tuple[Any, ...]:
    return _sql(url, "SELECT id, attempt, state FROM task_instances WHERE run_id = %s", (run_id,))[0]


def test_priority_then_fifo_order_the_claim_within_a_shard(db_url: str, engine: Engine) -> None:
    """On Citus the claim orders a queue's rows by priority, then oldest first, within
    each shard of the outbox (a run's shard), not across shards (docs/scaling.md,
    "Dispatch on Citus"): the runs here are placed on one shard."""
    ids = run_ids_on_one_shard(db_url, 5)
    low = engine.start("low", run_id=ids[0])
    high = engine.start("high", run_id=ids[1])
    mid = engine.start("mid", run_id=ids[2])
    low_later = engine.start("low", run_id=ids[3])
    high_later = engine.start("high", run_id=ids[4])
    assert [engine.claim(["q"], "w", 1)[0].run_id for _ in range(5)] == [high, high_later, mid, low, low_later]


def test_max_running_bounds_the_queue_and_a_place_is_freed_once_its_attempt_ends(db_url: str,
                                                                                engine: Engine) -> None:
    for _ in range(5):
        engine.start("low")
    engine.queues.set_limit("q", 2)
    first = engine.claim(["q"], "w1", 10)
    assert len(first) == 2
    assert engine.claim(["q"], "w2", 10) == []
    assert _slots(db_url) == [("queue:q", 2)]
    engine.complete(first[0], {"ok": True})
    assert _slots(db_url) == [("queue:q", 2)]                  # no trigger: freed by the claim that needs it
    (second,) = engine.claim(["q"], "w2", 10)
    assert _slots(db_url) == [("queue:q", 2)]
    engine.fail(first[1], "boom", retryable=False)
    assert len(engine.claim(["q"], "w2", 10)) == 1
    engine.queues.set_limit("q", 0)                            # no limit: the rest at once
    assert len(engine.claim(["q"], "w3", 10)) == 1
    running = _sql(db_url, "SELECT count(*) FROM task_instances WHERE state = 'RUNNING'")
    assert running == [(3,)]


def test_a_limit_set_while_attempts_run_counts_them(db_url: str, engine: Engine) -> None:
    """Attempts claimed on the nodes while the queue had no limit hold places once one is
    set (repo/queues.py, hold_running, on the coordinator's flow_slots); the claim that
    needs the places frees those of attempts that ended."""
    for _ in range(5):
        engine.start("low")
    running = engine.claim(["q"], "w1", 3)
    assert len(running) == 3
    engine.queues.set_limit("q", 2)
    assert _slots(db_url) == [("queue:q", 3)]
    assert engine.claim(["q"], "w2", 10) == []
    engine.complete(running[0], None)
    engine.complete(running[1], None)
    assert len(engine.claim(["q"], "w2", 10)) == 1
    assert engine.claim(["q"], "w3", 10) == []
    assert _sql(db_url, "SELECT count(*) FROM task_instances WHERE state = 'RUNNING'") == [(2,)]


def test_racing_claimers_never_pass_a_queue_limit_or_a_key_limit(db_url: str, engine: Engine) -> None:
    engine.deploy({**PERCUST, "nodes": [{**PERCUST["nodes"][0], "concurrency": {"key": "$.input.customer",
                                                                                "limit": 2}}]})
    for i in range(12):
        engine.start("low")
        engine.start("percust", input={"customer": "AB"[i % 2]})
    engine.queues.set_limit("q", 3)
    claimers = 8
    barrier = threading.Barrier(claimers)
    got: list[Claim] = []
    errors: list[BaseException] = []

    def claim(i: int) -> None:
        try:
            with Engine.connect(db_url, pool_size=1) as mine:
                barrier.wait(60)
                got.extend(mine.claim(["q", "k"], f"w{i}", 10))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sum(c.queue == "q" for c in got) == 3
    running = _sql(db_url, "SELECT input_json->>'customer', count(*) FROM task_instances "
                           "WHERE state = 'RUNNING' AND queue = 'k' GROUP BY 1 ORDER BY 1")
    assert running == [("A", 2), ("B", 2)]
    assert _slots(db_url) == [("c:A", 2), ("c:B", 2), ("queue:q", 3)]


def test_a_task_completing_on_its_node_while_a_claim_checks_its_slot_keeps_its_place(db_url: str,
                                                                                      engine: Engine) -> None:
    """The completion has not committed when the claim reads the task: it sees it
    RUNNING and keeps the slot (the key stays full for that claim); the next claim,
    after the commit, frees it."""
    engine.deploy(PERCUST)
    first, second = (engine.start("percust", input={"customer": "A"}) for _ in range(2))
    (held,) = engine.claim(["k"], "w", 10)
    assert held.run_id == first
    with psycopg.connect(db_url) as completing:                # the completion's node part, not committed
        completing.execute("UPDATE task_instances SET state = 'COMPLETED' WHERE run_id = %s AND id = %s",
                           (held.run_id, held.task_id))
        assert engine.claim(["k"], "w", 10) == []
        assert _slots(db_url) == [("c:A", 1)]
        completing.commit()
    (after,) = engine.claim(["k"], "w", 10)
    assert after.run_id == second
    assert _sql(db_url, "SELECT run_id FROM flow_slots") == [(second,)]


def test_a_slot_committed_before_its_tasks_claim_commits_on_the_node_holds_its_place(db_url: str,
                                                                                      engine: Engine) -> None:
    """Two-phase commit commits the coordinator first: a claim's slot (and the deletion
    of the dispatch it took) can be visible while its task is still QUEUED on the node.
    That slot holds its place; a check that freed every slot not RUNNING would let a
    second task of the key run."""
    engine.deploy(PERCUST)
    first, second = (engine.start("percust", input={"customer": "A"}) for _ in range(2))
    task_id, attempt, state = _task(db_url, first)
    assert state in ("PENDING", "QUEUED")
    with psycopg.connect(db_url) as conn:                      # the coordinator's half of the claim
        conn.execute("DELETE FROM task_outbox WHERE run_id = %s", (first,))
        conn.execute("INSERT INTO flow_slots (key, run_id, task_id, attempt) VALUES ('c:A', %s, %s, %s)",
                     (first, task_id, attempt))
    assert engine.claim(["k"], "w", 10) == []
    assert engine.coordinator().run_once(["leases"]).slots_freed == 0
    assert _slots(db_url) == [("c:A", 1)]
    with psycopg.connect(db_url) as conn:                      # the node's half commits
        conn.execute("UPDATE task_instances SET state = 'RUNNING', lease_owner = 'w0', "
                     "lease_expires_at = now() + interval '1 minute' WHERE run_id = %s", (first,))
    assert engine.claim(["k"], "w", 10) == []
    assert _task(db_url, second)[2] in ("PENDING", "QUEUED")


def test_a_lease_lost_and_requeued_frees_the_place_of_the_lost_attempt(db_url: str, engine: Engine) -> None:
    engine.deploy({**PERCUST, "nodes": [{**PERCUST["nodes"][0], "max_lease_expiries": 3}]})
    first, _ = (engine.start("percust", input={"customer": "A"}) for _ in range(2))
    (held,) = engine.claim(["k"], "w1", 10)
    assert held.run_id == first
    _sql(db_url, "UPDATE task_instances SET lease_expires_at = now() - interval '1 millisecond' "
                 "WHERE run_id = %s RETURNING id", (first,))
    assert engine.coordinator().run_once(["leases"]).leases_expired == 1
    assert _task(db_url, first)[1:] == (1, "PENDING")          # the next attempt, dispatched again
    (again,) = engine.claim(["k"], "w2", 10)                   # one place: one of the two, not both
    assert engine.claim(["k"], "w2", 10) == []
    assert _sql(db_url, "SELECT run_id, attempt FROM flow_slots") == [(again.run_id, again.attempt)]
    assert _sql(db_url, "SELECT count(*) FROM task_instances WHERE state = 'RUNNING'") == [(1,)]


def test_a_retried_run_takes_its_place_again(db_url: str, engine: Engine) -> None:
    """A run retried makes its tasks anew (new IDs): the slot its failed task left finds
    no task and is free, so the key is not held by the slot of an attempt that ended."""
    engine.deploy(PERCUST)
    run_id = engine.start("percust", input={"customer": "A"})
    (held,) = engine.claim(["k"], "w", 10)
    engine.fail(held, "fatal", retryable=False)
    assert engine.get_run(run_id).status == "FAILED"
    assert _sql(db_url, "SELECT attempt FROM flow_slots") == [(0,)]     # not freed yet: nobody needed it
    engine.retry(run_id)
    assert _task(db_url, run_id)[1:] in ((0, "PENDING"), (0, "QUEUED"))
    (again,) = engine.claim(["k"], "w", 10)
    assert again.run_id == run_id
    assert _slots(db_url) == [("c:A", 1)]


def test_the_lease_sweeper_frees_the_places_of_keys_at_their_limit(db_url: str, engine: Engine) -> None:
    engine.deploy(PERCUST)
    for _ in range(2):
        engine.start("percust", input={"customer": "A"})
        engine.start("low")
    engine.queues.set_limit("q", 1)
    for claim in engine.claim(["k", "q"], "w", 10):
        engine.complete(claim, None)
    assert _slots(db_url) == [("c:A", 1), ("queue:q", 1)]
    assert engine.coordinator().run_once(["leases"]).slots_freed == 2
    assert _slots(db_url) == []


def test_the_lease_sweeper_reads_no_shard_while_no_concurrency_key_holds_a_place(db_url: str,
                                                                                  engine: Engine) -> None:
    """The keys at their limit are found from the coordinator's tables first: while no
    concurrency key holds a place, the sweeper's pass does not read the outbox over
    every shard (a cluster without concurrency keys pays nothing for them at every pass).
    Seen by a lock: with the outbox locked, the read would wait for it."""
    engine.start("low")
    with psycopg.connect(db_url) as holder, psycopg.connect(db_url, autocommit=True) as conn:
        holder.execute("LOCK TABLE task_outbox IN ACCESS EXCLUSIVE MODE")     # held until the end
        conn.execute("SET statement_timeout = '5s'")
        assert citus_flow.free_stale(conn) == 0
        # A key holding a place: its limit is read from its ready dispatches (the outbox).
        conn.execute("INSERT INTO flow_slots (key, run_id, task_id, attempt) VALUES ('c:A', %s, 't', 0)",
                     (uuid7_text(),))
        with pytest.raises(psycopg.errors.QueryCanceled):
            citus_flow.free_stale(conn)
        holder.rollback()
    with psycopg.connect(db_url) as conn:       # the slot's task does not exist: its place is free
        assert citus_flow.free_stale(conn) == 0   # not at its limit (no ready dispatch of key A): kept


def test_a_claim_retried_after_a_lost_acknowledgement_takes_no_second_place(db_url: str, engine: Engine) -> None:
    for _ in range(2):
        engine.start("low")
    engine.queues.set_limit("q", 1)
    with psycopg.connect(db_url) as first:                     # the first attempt, its transaction left open
        assert len(citus.claim(first, ["q"], "w1", 2, claim_id="claim-F")) == 1
        result: list[list[Claim]] = []
        retry = threading.Thread(target=lambda: result.append(
            engine._claim(claim_ask(["q"], "w1", 2, None, "claim-F"), Request(tries=1))), daemon=True)
        retry.start()

        def waiting() -> bool:
            row = _sql(db_url, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
            return bool(row[0][0])

        wait_for(lambda: not retry.is_alive() or waiting(), timeout=60,
                 what="the retry to return or to wait for the first attempt")
        assert retry.is_alive(), f"the retry returned {result!r} while its first attempt was still open"
        first.commit()
    retry.join(60)
    assert [len(r) for r in result] == [1]
    assert _slots(db_url) == [("queue:q", 1)]
    assert engine.claim(["q"], "w2", 2) == []


@pytest.mark.parametrize("limit", [1, 3])
def test_a_key_at_its_limit_does_not_hold_up_the_keys_behind_it_across_claims(db_url: str, engine: Engine,
                                                                              limit: int) -> None:
    """Rows of a full key come first in the outbox; a claim asking for fewer than they
    are still reaches the other key's rows behind them."""
    engine.deploy({**PERCUST, "nodes": [{**PERCUST["nodes"][0], "concurrency": {"key": "$.input.customer",
                                                                                "limit": limit}}]})
    for _ in range(limit + 5):
        engine.start("percust", input={"customer": "A"})
    b = engine.start("percust", input={"customer": "B"})
    assert len(engine.claim(["k"], "w", limit)) == limit
    (other,) = engine.claim(["k"], "w", 1)
    assert other.run_id == b


def test_the_flow_claim_deletes_and_puts_back_each_outbox_row_on_its_shard_alone(db_url: str,
                                                                                 engine: Engine) -> None:
    """A settled outbox row is deleted, a kept one put back, each by a statement routed to
    the row's shard (the outbox's key is (run_id, id)), not one sent to every shard. The
    commands the coordinator sends to the shards are read from citus.log_remote_commands."""
    claimed, cancelled, requeued = (engine.start("low") for _ in range(3))
    engine.queues.set_limit("q", 5)                            # the coordinator's claim
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE task_instances SET state = 'CANCELLED' WHERE run_id = %s", (cancelled,))
        conn.execute("UPDATE task_outbox SET attempt = 1 WHERE run_id = %s", (requeued,))   # kept
    sent: list[str] = []
    with psycopg.connect(db_url) as conn:
        conn.add_notice_handler(lambda d: sent.append(d.message_primary or ""))
        conn.execute("SET citus.log_remote_commands = on")
        assert [c.run_id for c in citus.claim(conn, ["q"], "w1", 10, claim_id="claim-R")] == [claimed]
    deletes = [c for c in sent if re.search(r"DELETE FROM \S*task_outbox_\d+", c)]
    put_backs = [c for c in sent if re.search(r"UPDATE \S*task_outbox_\d+ ", c)]
    assert len(deletes) == 2, deletes
    assert len(put_backs) == 1, put_backs
    assert [r[0] for r in _sql(db_url, "SELECT run_id FROM task_outbox")] == [requeued]


def test_a_node_claim_looks_for_rows_under_flow_control_only_when_it_falls_short(db_url: str,
                                                                                  engine: Engine) -> None:
    """A node claim says whether its node has ready rows only the coordinator's claim
    takes (here, with a concurrency key) only when it gave fewer tasks than asked: the
    engine reads the flag only then, and the look is a statement per shard of the node,
    planned on every call (sql/citus/R__claim_node.sql)."""
    engine.deploy(PERCUST)
    ids = run_ids_on_one_shard(db_url, 2)
    plain = engine.start("low", run_id=ids[0])
    engine.start("percust", run_id=ids[1], input={"customer": "c1"})

    def claim_each_node(limit: int) -> tuple[list[str], list[bool]]:
        claimed: list[str] = []
        flags: list[bool] = []
        with psycopg.connect(db_url, autocommit=True) as conn:
            for key in citus.stream_keys(conn):
                got, limited = citus.claim_on_node(conn, key, ["q", "k"], "w", limit, None, claim_id=uuid7_text())
                claimed += [c.run_id for c in got]
                flags.append(limited)
        return claimed, flags

    assert claim_each_node(1) == ([plain], [False, False])       # its node gave 1 of 1, the other 0 of 1
    claimed, flags = claim_each_node(1)
    assert claimed == [] and sorted(flags) == [False, True]       # short on both, the key's row on one
