"""Every write path, cut at every request it sends (tests/faults/harness.py).

For each path the operation runs once through the fault proxy per case, and the
engine's own retry (``db_retry``) is what recovers; the check says what the caller
must see and what the database must hold afterwards, which is the same whatever
the fault: exactly the effect of one operation, and the original outcome returned.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

import pytest

from composer_ops.engine.retention import drop_due_months
from composer_ops.engine.shell import Outcome
from composer_ops.engine.webhooks import RelayPolicy
from composer_ops.repo import partitions
from composer_ops.repo.partitions import RUN_TABLES
from composer_ops.repo.rows import Claim
from composer_ops.testing.servers import Server
from tests.chaos.hook import Hook
from tests.faults.harness import Bench, Result, bench, expire_leases, make_due, sweep
from tests.integration.helpers import now_utc, uuid7_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHAIN = {"id": "f-chain", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "queue": "fq"},
    {"id": "b", "type": "TASK", "task": "t", "queue": "fq", "depends_on": ["a"]}]}
RETRIED = {"id": "f-retried", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "queue": "fq",
     "retry": {"max_attempts": 3, "initial_backoff_s": 0, "multiplier": 1, "max_backoff_s": 0}}]}
TIMERS_AND_LEASES = ("timers", "leases")
TWO_WAITERS = {"id": "f-two-waiters", "nodes": [
    {"id": "w1", "type": "WAIT_FOR_EVENT", "event": "go"},
    {"id": "w2", "type": "WAIT_FOR_EVENT", "event": "go"},
    {"id": "after", "type": "TASK", "task": "t", "queue": "fq", "depends_on": ["w1", "w2"]}]}
ONE_WAITER = {"id": "f-one-waiter", "nodes": [{"id": "w", "type": "WAIT_FOR_EVENT", "event": "go"}]}
TIMER = {"id": "f-timer", "nodes": [
    {"id": "z", "type": "WAIT", "duration_s": 3600},
    {"id": "b", "type": "TASK", "task": "t", "queue": "fq", "depends_on": ["z"]}]}


@pytest.fixture(scope="module")
def b(server: Server, template_db: str) -> Iterator[Bench]:
    """One database for the module: every case works on runs of its own (a claim's
    case first cancels what earlier cases left active)."""
    with server.database(template=template_db) as url, bench(url) as fb:
        for spec in (CHAIN, RETRIED, TWO_WAITERS, ONE_WAITER, TIMER):
            fb.direct.deploy(spec)
        yield fb


def _token() -> str:
    return uuid.uuid4().hex


def _nodes(b: Bench, run_id: str) -> dict[str, tuple[str, int]]:
    return {t.node_id: (t.state, t.attempt) for t in b.direct.get_run(run_id).tasks}


def _outbox(b: Bench, run_id: str) -> list[tuple[str, int]]:
    return [(r[0], r[1]) for r in b.sql(
        "SELECT t.node_id, o.attempt FROM task_outbox o JOIN task_instances t ON t.run_id = o.run_id "
        "AND t.id = o.task_id WHERE o.run_id = %s ORDER BY 1", (run_id,))]


def _quiesce(b: Bench) -> None:
    """Cancel what earlier cases left active, so a claim finds only this case's task."""
    for (run_id,) in b.sql("SELECT id FROM workflow_runs WHERE status = 'RUNNING'"):
        b.direct.cancel(run_id, reason="next case")


def _claim_one(b: Bench, owner: str = "w-direct") -> Claim:
    claims = b.direct.claim(["fq"], owner, 1)
    assert len(claims) == 1, claims
    return claims[0]


def _raised(result: Result) -> list[str]:
    return [] if result.error is None else [f"the call raised {type(result.error).__name__}: {result.error}"]


def _applied(result: Result) -> list[str]:
    if result.error is not None:
        return _raised(result)
    outcome = result.value
    if isinstance(outcome, Outcome) and outcome.stale:
        return [f"the call reported its own applied event as stale: {outcome.stale}"]
    return []


# -- start ------------------------------------------------------------------------------


def test_start(b: Bench) -> None:
    def setup() -> str:
        return _token()

    def act(token: str) -> str:
        return b.engine.start("f-chain", input={"token": token})

    def check(token: str, result: Result) -> list[str]:
        runs = [r[0] for r in b.sql("SELECT id FROM workflow_runs WHERE input_json->>'token' = %s", (token,))]
        if len(runs) != 1:
            return [f"{len(runs)} runs for one start"] + _raised(result)
        problems = _raised(result)
        if result.error is None and result.value != runs[0]:
            problems.append(f"start returned {result.value}, the run is {runs[0]}")
        if _nodes(b, runs[0]) != {"a": ("PENDING", 0)} or _outbox(b, runs[0]) != [("a", 0)]:
            problems.append(f"tasks {_nodes(b, runs[0])}, outbox {_outbox(b, runs[0])}")
        return problems

    sweep(b, "start", setup=setup, act=act, check=check).assert_clean()


def test_start_with_a_client_run_id(b: Bench) -> None:
    """The client's run ID is its idempotency key: a retry after a lost acknowledgement
    must return the run it started, not Conflict."""
    def setup() -> str:
        return uuid7_at(now_utc())

    def act(run_id: str) -> str:
        return b.engine.start("f-chain", input={"k": 1}, run_id=run_id)

    def check(run_id: str, result: Result) -> list[str]:
        n = b.sql("SELECT count(*) FROM workflow_runs WHERE id = %s", (run_id,))[0][0]
        problems = [] if n == 1 else [f"{n} runs"]
        if result.error is not None or result.value != run_id:
            problems.append(f"start returned {result.value!r} / raised {result.error!r}, not the run ID")
        return problems

    sweep(b, "start (client run ID)", setup=setup, act=act, check=check).assert_clean()


# -- signal, cancel ---------------------------------------------------------------------------


def test_signal_resolves_at_most_one_node(b: Bench) -> None:
    def setup() -> tuple[str, str]:
        return b.direct.start("f-two-waiters"), _token()

    def act(state: tuple[str, str]) -> Outcome:
        run_id, token = state
        return b.engine.signal(run_id, "go", payload={"token": token})

    def check(state: tuple[str, str], result: Result) -> list[str]:
        run_id, token = state
        view = b.direct.get_run(run_id)
        resolved = [t.node_id for t in view.tasks if t.output == {"token": token}]
        buffered = b.sql("SELECT count(*) FROM workflow_events WHERE run_id = %s", (run_id,))[0][0]
        problems = _applied(result)
        if len(resolved) + buffered != 1:
            problems.append(f"one signal resolved {resolved} and was buffered {buffered} times")
        return problems

    sweep(b, "signal (two waiters)", setup=setup, act=act, check=check).assert_clean()


def test_a_signal_that_finishes_the_run(b: Bench) -> None:
    def setup() -> str:
        return b.direct.start("f-one-waiter")

    def act(run_id: str) -> Outcome:
        return b.engine.signal(run_id, "go", payload={"x": 1})

    def check(run_id: str, result: Result) -> list[str]:
        status = b.direct.get_run(run_id).status
        return _applied(result) + ([] if status == "SUCCEEDED" else [f"run is {status}"])

    sweep(b, "signal (finishes the run)", setup=setup, act=act, check=check).assert_clean()


def test_a_buffered_signal(b: Bench) -> None:
    """Two signals resolve both waiters (the run then waits on its TASK, still
    RUNNING); the third finds no waiter and must be buffered exactly once."""
    def setup() -> tuple[str, str]:
        run_id = b.direct.start("f-two-waiters")
        b.direct.signal(run_id, "go", payload={"first": 1})
        b.direct.signal(run_id, "go", payload={"second": 2})
        return run_id, _token()

    def act(state: tuple[str, str]) -> Outcome:
        run_id, token = state
        return b.engine.signal(run_id, "go", payload={"token": token})

    def check(state: tuple[str, str], result: Result) -> list[str]:
        run_id, token = state
        rows = b.sql("SELECT count(*) FROM workflow_events WHERE run_id = %s AND payload->>'token' = %s",
                     (run_id, token))[0][0]
        problems = _applied(result)
        if rows != 1:
            problems.append(f"the signal was buffered {rows} times")
        return problems

    sweep(b, "signal (buffered)", setup=setup, act=act, check=check).assert_clean()


def test_cancel(b: Bench) -> None:
    def setup() -> str:
        return b.direct.start("f-chain")

    def act(run_id: str) -> Outcome:
        return b.engine.cancel(run_id, reason="by test")

    def check(run_id: str, result: Result) -> list[str]:
        status = b.direct.get_run(run_id).status
        return _applied(result) + ([] if status == "CANCELLED" else [f"run is {status}"])

    sweep(b, "cancel", setup=setup, act=act, check=check).assert_clean()


# -- the worker's writes -------------------------------------------------------------------------


@dataclass
class Claimed:
    run_id: str
    claim: Claim
    before: datetime | None = None


def test_claim(b: Bench) -> None:
    """Whatever the claim returns, the task must end up run exactly by an attempt
    that holds it, and the run must succeed: a claim whose acknowledgement was lost
    leaves the task leased to nobody, which the lease sweeper must re-queue without
    counting it as a failed attempt (the default policy allows one attempt)."""
    def setup() -> str:
        _quiesce(b)
        return b.direct.start("f-chain")

    def act(run_id: str) -> list[Claim]:
        return b.engine.claim(["fq"], "w-proxied", 1)

    def check(run_id: str, result: Result) -> list[str]:
        problems = _raised(result)
        claims = result.value or []
        for c in claims:
            row = b.sql("SELECT state, attempt, lease_owner FROM task_instances WHERE run_id = %s AND id = %s",
                        (c.run_id, c.task_id))[0]
            if row != ("RUNNING", c.attempt, "w-proxied"):
                problems.append(f"the claim returned attempt {c.attempt} but the task is {row}: "
                                "a handler would run an attempt it does not hold")
        if not claims:
            # the lease lapses, a coordinator sweeps, a worker claims again
            expire_leases(b, run_id)
            b.direct.coordinator().run_once(TIMERS_AND_LEASES)
            claims = b.direct.claim(["fq"], "w-direct", 1)
            if not claims:
                return problems + [f"after the lease lapsed the task was not claimable: {_nodes(b, run_id)}, "
                                   f"run {b.direct.get_run(run_id).status}"]
        b.direct.complete(claims[0], {"ok": True})
        nodes = _nodes(b, run_id)
        if nodes.get("a", ("", 0))[0] != "COMPLETED" or b.direct.get_run(run_id).status != "RUNNING":
            problems.append(f"after completing the claimed task: {nodes}, run {b.direct.get_run(run_id).status}")
        return problems

    sweep(b, "claim", setup=setup, act=act, check=check).assert_clean()


def test_complete(b: Bench) -> None:
    def setup() -> Claimed:
        _quiesce(b)
        run_id = b.direct.start("f-chain")
        return Claimed(run_id, _claim_one(b))

    def act(s: Claimed) -> Outcome:
        return b.engine.complete(s.claim, {"done": True})

    def check(s: Claimed, result: Result) -> list[str]:
        nodes, outbox = _nodes(b, s.run_id), _outbox(b, s.run_id)
        problems = _applied(result)
        if nodes != {"a": ("COMPLETED", 0), "b": ("PENDING", 0)} or outbox != [("b", 0)]:
            problems.append(f"tasks {nodes}, outbox {outbox}")
        return problems

    sweep(b, "complete", setup=setup, act=act, check=check).assert_clean()


def test_fail_retryable(b: Bench) -> None:
    def setup() -> Claimed:
        _quiesce(b)
        run_id = b.direct.start("f-retried")
        return Claimed(run_id, _claim_one(b))

    def act(s: Claimed) -> Outcome:
        return b.engine.fail(s.claim, "boom", retryable=True)

    def check(s: Claimed, result: Result) -> list[str]:
        nodes, outbox = _nodes(b, s.run_id), _outbox(b, s.run_id)
        problems = _applied(result)
        if nodes != {"a": ("PENDING", 1)} or outbox != [("a", 1)]:
            problems.append(f"one failure: tasks {nodes}, outbox {outbox} (attempt 1 expected)")
        return problems

    sweep(b, "fail (retried)", setup=setup, act=act, check=check).assert_clean()


def test_fail_for_good(b: Bench) -> None:
    def setup() -> Claimed:
        _quiesce(b)
        run_id = b.direct.start("f-chain")
        return Claimed(run_id, _claim_one(b))

    def act(s: Claimed) -> Outcome:
        return b.engine.fail(s.claim, "fatal", retryable=False)

    def check(s: Claimed, result: Result) -> list[str]:
        nodes, status = _nodes(b, s.run_id), b.direct.get_run(s.run_id).status
        problems = _applied(result)
        if nodes != {"a": ("FAILED", 0)} or status != "FAILED":
            problems.append(f"tasks {nodes}, run {status}")
        return problems

    sweep(b, "fail (for good)", setup=setup, act=act, check=check).assert_clean()


def test_heartbeat(b: Bench) -> None:
    def setup() -> Claimed:
        _quiesce(b)
        run_id = b.direct.start("f-chain")
        claim = _claim_one(b)
        return Claimed(run_id, claim, claim.lease_expires_at)

    def act(s: Claimed) -> datetime | None:
        return b.engine.heartbeat(s.claim)

    def check(s: Claimed, result: Result) -> list[str]:
        problems = _raised(result)
        if result.error is None and result.value is None:
            problems.append("the heartbeat reported a lease it still holds as lost")
        row = b.sql("SELECT state, lease_owner, lease_expires_at > %s FROM task_instances "
                    "WHERE run_id = %s AND id = %s", (s.before, s.run_id, s.claim.task_id))[0]
        if row[:2] != ("RUNNING", "w-direct"):
            problems.append(f"the heartbeat changed the task: {row}")
        return problems

    sweep(b, "heartbeat", setup=setup, act=act, check=check).assert_clean()


# -- the coordinator's writes --------------------------------------------------------------------


def test_timer(b: Bench) -> None:
    def setup() -> str:
        _quiesce(b)
        run_id = b.direct.start("f-timer")
        make_due(b, run_id)
        return run_id

    def act(run_id: str) -> Any:
        return b.engine.coordinator().run_once(["timers"])

    def check(run_id: str, result: Result) -> list[str]:
        problems = _raised(result)
        nodes, outbox = _nodes(b, run_id), _outbox(b, run_id)
        if nodes != {"z": ("COMPLETED", 0), "b": ("PENDING", 0)} or outbox != [("b", 0)]:
            # a pass cut by a fault leaves the timer for the next pass: run one
            b.direct.coordinator().run_once(TIMERS_AND_LEASES)
            nodes, outbox = _nodes(b, run_id), _outbox(b, run_id)
            if nodes != {"z": ("COMPLETED", 0), "b": ("PENDING", 0)} or outbox != [("b", 0)]:
                problems.append(f"after the timer fired: tasks {nodes}, outbox {outbox}")
        return problems

    sweep(b, "timer", setup=setup, act=act, check=check).assert_clean()


def test_lease_sweep_requeues_once(b: Bench) -> None:
    def setup() -> Claimed:
        _quiesce(b)
        run_id = b.direct.start("f-retried")
        claim = _claim_one(b)
        expire_leases(b, run_id)
        return Claimed(run_id, claim)

    def act(s: Claimed) -> Any:
        return b.engine.coordinator().run_once(["leases"])

    def check(s: Claimed, result: Result) -> list[str]:
        problems = _raised(result)
        nodes = _nodes(b, s.run_id)
        if nodes["a"] == ("RUNNING", 0):        # the pass was cut before the sweep: the next pass sweeps
            b.direct.coordinator().run_once(TIMERS_AND_LEASES)
            nodes = _nodes(b, s.run_id)
        if nodes != {"a": ("PENDING", 1)} or _outbox(b, s.run_id) != [("a", 1)]:
            problems.append(f"one expiry: tasks {nodes}, outbox {_outbox(b, s.run_id)} (attempt 1 expected)")
        if b.direct.get_run(s.run_id).status != "RUNNING":
            problems.append(f"run {b.direct.get_run(s.run_id).status}")
        return problems

    sweep(b, "lease sweep", setup=setup, act=act, check=check).assert_clean()


def test_lease_expiry_does_not_consume_an_attempt(b: Bench) -> None:
    """A lease expiry is not a handler failure: under the default policy (one attempt)
    the task is re-queued as attempt 1 and the run goes on."""
    def setup() -> Claimed:
        _quiesce(b)
        run_id = b.direct.start("f-chain")
        claim = _claim_one(b)
        expire_leases(b, run_id)
        return Claimed(run_id, claim)

    def act(s: Claimed) -> Any:
        return b.engine.coordinator().run_once(["leases"])

    def check(s: Claimed, result: Result) -> list[str]:
        problems = _raised(result)
        nodes = _nodes(b, s.run_id)
        if nodes["a"] == ("RUNNING", 0):
            b.direct.coordinator().run_once(TIMERS_AND_LEASES)
            nodes = _nodes(b, s.run_id)
        status = b.direct.get_run(s.run_id).status
        if nodes != {"a": ("PENDING", 1)} or status != "RUNNING":
            problems.append(f"after one expiry: tasks {nodes}, run {status}")
        return problems

    sweep(b, "lease expiry (default policy)", setup=setup, act=act, check=check).assert_clean()


def test_webhook_relay(b: Bench) -> None:
    """Whatever the connection fault, the delivery is POSTed exactly once and recorded."""
    hook = Hook(fail_share=2**40)
    relay = RelayPolicy(lease_s=0.3)
    b.direct.deploy({"id": "f-hook", "webhook_url": hook.base, "nodes": [ONE_WAITER["nodes"][0]]})
    try:
        def setup() -> str:
            run_id = b.direct.start("f-hook")
            b.direct.signal(run_id, "go")
            return run_id

        def act(run_id: str) -> Any:
            return b.engine.coordinator(relay=relay).run_once(["webhooks"])

        def settle(run_id: str) -> None:
            def delivered() -> bool:
                return bool(b.sql("SELECT delivered_at IS NOT NULL FROM webhook_deliveries WHERE run_id = %s",
                                  (run_id,))[0][0])
            deadline = time.monotonic() + 10
            while not delivered() and time.monotonic() < deadline:
                time.sleep(0.1)
                b.direct.coordinator(relay=relay).run_once(["webhooks"])

        def check(run_id: str, result: Result) -> list[str]:
            row = b.sql("SELECT delivered_at IS NOT NULL, attempts FROM webhook_deliveries WHERE run_id = %s",
                        (run_id,))
            posts = hook.received.get(run_id, [])
            problems = _raised(result)
            if not row or not row[0][0]:
                problems.append(f"the delivery was not recorded as delivered: {row}")
            if posts != ["SUCCEEDED"]:
                # connection faults cost no duplicate: a POST is repeated only when the relay
                # dies between it and its record (the chaos run counts those)
                problems.append(f"the receiver got {posts}")
            return problems

        sweep(b, "webhook relay", setup=setup, act=act, check=check, settle=settle).assert_clean()
    finally:
        hook.close()


def test_webhook_prune(b: Bench) -> None:
    """Deliveries finished more than the kept days ago go, all of them, whatever the
    fault (a retried batch deletes what is left); younger and pending ones stay."""
    b.direct.deploy({"id": "f-pruned", "webhook_url": "http://127.0.0.1:9/never", "nodes": [ONE_WAITER["nodes"][0]]})

    def finished_run(days_ago: int, delivered: bool = True) -> str:
        run_id = b.direct.start("f-pruned")
        b.direct.signal(run_id, "go")
        if delivered:
            b.sql("UPDATE webhook_deliveries SET delivered_at = now() - make_interval(days => %s) WHERE run_id = %s",
                  (days_ago, run_id))
        b.sql("UPDATE workflow_runs SET completed_at = now() - make_interval(days => %s) WHERE id = %s",
              (days_ago, run_id))
        return run_id

    def setup() -> tuple[list[str], list[str]]:
        return [finished_run(9), finished_run(8)], [finished_run(2), finished_run(9, delivered=False)]

    def act(_: tuple[list[str], list[str]]) -> Any:
        return b.engine.coordinator(webhook_keep_days=7).run_once(["webhooks"])

    def check(state: tuple[list[str], list[str]], result: Result) -> list[str]:
        old, kept = state
        left = {r[0] for r in b.sql("SELECT run_id FROM webhook_deliveries")}
        problems = _raised(result)
        if result.error is None and result.value.errors:
            problems.append(f"the pass reported {result.value.errors}")
        if left & set(old):
            problems.append(f"deliveries older than 7 days left: {sorted(left & set(old))}")
        if set(kept) - left:
            problems.append(f"younger or pending deliveries pruned: {sorted(set(kept) - left)}")
        return problems

    sweep(b, "webhook prune", setup=setup, act=act, check=check).assert_clean()


def test_partition_upkeep(b: Bench) -> None:
    months = [r[0] for r in b.sql(
        "SELECT to_char((date_trunc('month', now() AT TIME ZONE 'UTC') + make_interval(months => i)), 'YYYYMM') "
        "FROM generate_series(0, 5) i")]

    def setup() -> None:
        for month in months[4:]:
            for table in ("workflow_events", "task_instances"):
                b.sql(f"DROP TABLE IF EXISTS {table}_p{month}")
            if b.sql("SELECT to_regclass(%s) IS NOT NULL", (f"workflow_runs_p{month}",))[0][0]:
                b.sql(f"ALTER TABLE workflow_runs DETACH PARTITION workflow_runs_p{month}")
                b.sql(f"DROP TABLE workflow_runs_p{month}")

    def act(_: None) -> Any:
        return b.engine.coordinator(months_ahead=5).run_once(["partitions"])

    def check(_: None, result: Result) -> list[str]:
        problems = _raised(result)
        have = {(p.table, p.month) for p in _partitions(b)}
        if not all((t, m) in have for t in RUN_TABLES for m in months):
            # the pass was cut: the next one (upkeep is retried on every pass until it succeeds) creates them
            b.direct.coordinator(months_ahead=5).run_once(["partitions"])
            have = {(p.table, p.month) for p in _partitions(b)}
        missing = [(t, m) for t in RUN_TABLES for m in months if (t, m) not in have]
        return problems + ([f"partitions missing after upkeep: {missing}"] if missing else [])

    sweep(b, "partition upkeep", setup=setup, act=act, check=check).assert_clean()


def test_retention_drop(b: Bench) -> None:
    """The month is dropped exactly when the plan says so, the report names it even
    when the acknowledgement of the drop was lost, and no other month is touched."""
    old = date(2020, 1, 1)
    keep = b.direct.start("f-chain")

    def setup() -> None:
        b.sql("SELECT composer_ensure_partitions_from(%s, 0)", (old,))
        b.sql("INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status) "
              "VALUES (%s, 'f-chain', 1, 'SUCCEEDED')", (uuid7_at(datetime(2020, 1, 15, tzinfo=UTC)),))

    def act(_: None) -> Any:
        return drop_due_months(b.proxy.url(), datetime(2021, 1, 1, tzinfo=UTC))

    def check(_: None, result: Result) -> list[str]:
        problems = _raised(result)
        if result.error is None and result.value.dropped != ["202001"]:
            problems.append(f"the drop reported {result.value.dropped}, not the month it dropped")
        left = {p.month for p in _partitions(b)}
        if "202001" in left:
            problems.append("the month is still there")
        if b.direct.get_run(keep).status != "RUNNING":
            problems.append("a run of another month changed")
        return problems

    sweep(b, "retention drop", setup=setup, act=act, check=check).assert_clean()


def test_delete_run(b: Bench) -> None:
    """A delete retried after a lost acknowledgement returns what its lost attempt did."""
    def setup() -> str:
        run_id = b.direct.start("f-one-waiter")
        b.direct.signal(run_id, "go")
        return run_id

    def act(run_id: str) -> Any:
        return b.engine.delete_run(run_id)

    def check(run_id: str, result: Result) -> list[str]:
        problems = _raised(result)
        row = b.sql("SELECT status, deleted_at IS NOT NULL FROM workflow_runs WHERE id = %s", (run_id,))
        if row != [("SUCCEEDED", True)]:
            problems.append(f"after one delete the run is {row}")
        if result.error is None and result.value.already:
            problems.append("the delete reported the run as deleted before it: its own lost attempt")
        return problems

    sweep(b, "delete run", setup=setup, act=act, check=check).assert_clean()


def test_retry_run(b: Bench) -> None:
    """A retry from a node retried after a lost acknowledgement returns what its lost
    attempt did, and the run is reopened once: one new task, one dispatch, one audit row."""
    def setup() -> str:
        _quiesce(b)
        run_id = b.direct.start("f-chain")
        b.direct.fail(_claim_one(b), "fatal", retryable=False)
        return run_id

    def act(run_id: str) -> Any:
        return b.engine.retry(run_id)

    def check(run_id: str, result: Result) -> list[str]:
        problems = _raised(result)
        if result.error is None and not (result.value.applied and result.value.reset == ("a",)):
            problems.append(f"the retry returned {result.value}")
        status, nodes = b.direct.get_run(run_id).status, _nodes(b, run_id)
        if status != "RUNNING" or nodes != {"a": ("PENDING", 0)}:
            problems.append(f"after one retry: run {status}, tasks {nodes}")
        if (dispatches := _outbox(b, run_id)) != [("a", 0)]:
            problems.append(f"dispatches {dispatches}")
        audits = b.sql("SELECT count(*) FROM operator_audit WHERE action = 'runs retry' AND target = %s", (run_id,))
        if audits != [(1,)]:
            problems.append(f"audit rows {audits}")
        return problems

    sweep(b, "retry run", setup=setup, act=act, check=check).assert_clean()


def test_bulk_cancel(b: Bench) -> None:
    """A bulk cancel whose chunk loses its acknowledgement finds the chunk's audit row on
    retry: every selected run is cancelled once and reported once, one audit row a chunk."""
    def setup() -> tuple[str, list[str]]:
        token = _token()
        return token, sorted(b.direct.start("f-chain", input={"token": token}) for _ in range(3))

    def act(s: tuple[str, list[str]]) -> Any:
        return b.engine.cancel_runs(where={"token": s[0]}, yes=True, chunk=2)

    def check(s: tuple[str, list[str]], result: Result) -> list[str]:
        token, started = s
        problems = _raised(result)
        if result.error is None and sorted(result.value.cancelled) != started:
            problems.append(f"reported cancelled {result.value.cancelled}, started {started}")
        statuses = [b.direct.get_run(r).status for r in started]
        if statuses != ["CANCELLED"] * 3:
            problems.append(f"runs {statuses}")
        chunks = b.sql("SELECT detail->'cancelled' FROM operator_audit WHERE action = 'runs cancel' "
                       "AND detail->'cancelled' ?| %s", (started,))
        if sorted(r for (rows,) in chunks for r in rows) != started or len(chunks) != 2:
            problems.append(f"audit rows {chunks}")
        return problems

    sweep(b, "bulk cancel", setup=setup, act=act, check=check).assert_clean()


def _partitions(b: Bench) -> list[Any]:
    with b.direct.pool.connection() as conn:
        return partitions.list_partitions(conn)
