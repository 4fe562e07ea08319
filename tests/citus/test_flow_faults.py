"""The Citus flow-control write paths cut at every request (tests/faults/harness.py's
sweep, its drops and held commits; a Citus node is not restarted here): a claim of a
limited queue, a claim of a concurrency key, each also freeing a finished attempt's
slot on the way, and the lease sweeper's pass that frees slots. Whatever was cut, at
most one task of the limit RUNNING, every RUNNING task holding its place, and once
it completes the other task is claimable."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from composer_ops import Conflict, Engine
from composer_ops.testing.faultproxy import FaultProxy
from tests.faults import harness
from tests.faults.harness import DROPS, HOLDS, Bench, Result, expire_leases, sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LIMITED = {"id": "f-limited", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "queue": "fl"},
    {"id": "b", "type": "TASK", "task": "t", "queue": "fl"}]}
KEYED = {"id": "f-keyed", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "fk",
                                     "concurrency": {"key": "$.input.customer", "limit": 1}}]}


def citus_invariants(db_url: str) -> list[str]:
    """tests/faults/harness.py's invariants on Citus: those joining the coordinator's
    outbox or deliveries to the run tables (which Citus refuses to join directly) are
    checked here by reading both sides; the others run as they are."""
    out: list[str] = []
    with psycopg.connect(db_url, autocommit=True) as conn:
        for what, query in harness.INVARIANTS.items():
            if "task_outbox" not in query and "webhook_deliveries" not in query:
                rows = conn.execute(query).fetchall()
                if rows:
                    out.append(f"{what}: {rows[:3]}")
        outbox = {(r, t, a) for r, t, a in conn.execute("SELECT run_id, task_id, attempt FROM task_outbox")}
        tasks = conn.execute("""
            SELECT t.run_id, t.id, t.attempt, t.state, r.status FROM task_instances t
              JOIN workflow_runs r ON r.id = t.run_id
             WHERE t.node_type = 'TASK'""").fetchall()
    waiting = {(r, t, a) for r, t, a, state, _ in tasks if state in ("PENDING", "QUEUED")}
    undispatched = [w[:3] for w in tasks if w[3] in ("PENDING", "QUEUED") and w[4] in ("PENDING", "RUNNING")
                    and w[:3] not in outbox]
    if undispatched:
        out.append(f"a PENDING task has no dispatch (it will never run): {undispatched[:3]}")
    if outbox - waiting:
        out.append(f"an outbox row whose task attempt is not waiting for dispatch: {sorted(outbox - waiting)[:3]}")
    return out


@pytest.fixture(scope="module")
def b(citus_db: str) -> Iterator[Bench]:
    with pytest.MonkeyPatch.context() as patch, FaultProxy(citus_db) as proxy, \
            Engine.connect(citus_db, pool_size=2, application_name="faults-direct") as direct, \
            Engine.connect(proxy.url(), pool_size=1, application_name="faults-proxied") as engine:
        direct.deploy(LIMITED)
        direct.deploy(KEYED)
        direct.queues.set_limit("fl", 1)
        patch.setattr(harness, "invariant_problems", citus_invariants)
        yield Bench(db_url=citus_db, proxy=proxy, direct=direct, engine=engine)


def _clear(b: Bench) -> None:
    """Cancel what earlier cases left running, so a claim sees only this case's tasks. A
    run that ended between the read and its cancel is refused with Conflict: it is no
    longer running, as wanted."""
    for (run_id,) in b.sql("SELECT id FROM workflow_runs WHERE status = 'RUNNING'"):
        try:
            b.direct.cancel(run_id, reason="next case")
        except Conflict:
            assert b.direct.get_run(run_id).status != "RUNNING", run_id


def _finished_then(b: Bench, queue: str, start: Callable[[], str], count: int) -> list[str]:
    """A task of the limit claimed and completed (its place left for a claim to free),
    then ``count`` runs ready, made by ``start``."""
    _clear(b)
    start()
    claims = b.direct.claim([queue], "w-direct", 1)
    assert len(claims) == 1, claims
    b.direct.complete(claims[0], None)
    _clear(b)
    return [start() for _ in range(count)]


def _limited(b: Bench) -> list[str]:
    return _finished_then(b, "fl", lambda: b.direct.start("f-limited"), 1)


def _keyed(b: Bench) -> list[str]:
    customer = uuid.uuid4().hex
    return _finished_then(b, "fk", lambda: b.direct.start("f-keyed", input={"customer": customer}), 2)


def _one_at_a_time(queue: str, key: Callable[[list[str]], str]) -> Callable[[Bench, list[str], Result], list[str]]:
    def check(b: Bench, runs: list[str], result: Result) -> list[str]:
        problems = [] if result.error is None else [f"raised {type(result.error).__name__}: {result.error}"]
        running = b.sql("SELECT run_id, id, attempt FROM task_instances WHERE run_id = ANY(%s) AND state = 'RUNNING'",
                        (runs,))
        slots = b.sql("SELECT run_id, task_id, attempt FROM flow_slots WHERE key = %s AND run_id = ANY(%s)",
                      (key(runs), runs))
        if len(running) > 1 or sorted(running) != sorted(slots):
            problems.append(f"RUNNING {running} and places {slots} under a limit of 1")
        claims = result.value or []
        if not claims:
            for run_id in runs:
                expire_leases(b, run_id)
            b.direct.coordinator().run_once(["timers", "leases"])
            claims = b.direct.claim([queue], "w-direct", 2)
        if len(claims) != 1:
            return problems + [f"expected one task claimable under the limit, got {len(claims)}"]
        b.direct.complete(claims[0], None)
        if len(b.direct.claim([queue], "w-direct", 2)) != 1:
            problems.append("the other task was not claimable once the first completed")
        return problems
    return check


def _customer(b: Bench) -> Callable[[list[str]], str]:
    def key(runs: list[str]) -> str:
        (row,) = b.sql("SELECT DISTINCT input_json->>'customer' FROM workflow_runs WHERE id = ANY(%s)", (runs,))
        return "c:" + str(row[0])
    return key


def _swept(b: Bench, name: str, setup: Callable[[], Any], act: Callable[[Any], Any],
           check: Callable[[Any, Result], list[str]]) -> None:
    out = sweep(b, name, setup=setup, act=act, check=check, faults=DROPS + HOLDS)
    assert len(out.cases) > 2 * len(out.recorded) >= 4, out.tally()
    assert not out.failures, "\n".join([f"{name}: {len(out.failures)} of {len(out.cases)} cases broke it"]
                                       + [f"  {c}" for c in out.failures[:10]])


def test_claim_of_a_limited_queue_freeing_a_finished_place(b: Bench) -> None:
    _swept(b, "claim (limited queue, Citus)", lambda: _limited(b),
           lambda _: b.engine.claim(["fl"], "w-proxied", 2),
           lambda runs, result: _one_at_a_time("fl", lambda _: "queue:fl")(b, runs, result))


def test_claim_of_a_concurrency_key_freeing_a_finished_place(b: Bench) -> None:
    _swept(b, "claim (concurrency key, Citus)", lambda: _keyed(b),
           lambda _: b.engine.claim(["fk"], "w-proxied", 2),
           lambda runs, result: _one_at_a_time("fk", _customer(b))(b, runs, result))


def test_the_lease_sweepers_pass_freeing_places(b: Bench) -> None:
    def check(runs: list[str], result: Result) -> list[str]:
        problems = [] if result.error is None else [f"raised {type(result.error).__name__}: {result.error}"]
        key = _customer(b)(runs)
        if b.sql("SELECT count(*) FROM flow_slots WHERE key = %s", (key,))[0][0]:
            b.direct.coordinator().run_once(["leases"])        # a pass cut short leaves it to the next
        left = b.sql("SELECT count(*) FROM flow_slots WHERE key = %s", (key,))[0][0]
        if left != 0:
            problems.append(f"{left} place(s) of a finished attempt left after the next pass")
        return problems + _one_at_a_time("fk", _customer(b))(b, runs, Result(value=[]))

    _swept(b, "lease sweep (frees places, Citus)", lambda: _keyed(b),
           lambda _: b.engine.coordinator().run_once(["leases"]), check)
