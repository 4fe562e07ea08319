"""The write paths' state and checks for the fault sweep (tests/faults/test_write_paths.py):
the definitions the sweep deploys, the rig, how each case builds its state through the
direct engine, and what each must leave. The operator actions' cases are in ops_cases.py."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from composer_ops.engine.requests import Request
from composer_ops.engine.shell import Outcome
from composer_ops.engine.webhooks import RelayPolicy
from composer_ops.repo import outbox, partitions
from composer_ops.repo.partitions import RUN_TABLES
from composer_ops.repo.rows import Claim
from tests.chaos.hook import Hook
from tests.faults.harness import Bench, Result, expire_leases, make_due

CHAIN = {"id": "f-chain", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "queue": "fq"},
    {"id": "b", "type": "TASK", "task": "t", "queue": "fq", "depends_on": ["a"]}]}
RETRIED = {"id": "f-retried", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "queue": "fq",
     "retry": {"max_attempts": 3, "initial_backoff_s": 0, "multiplier": 1, "max_backoff_s": 0}}]}
TIMERS_AND_LEASES = ("timers", "leases")
TWO_WAITERS = {"id": "f-two-waiters", "nodes": [
    {"id": "w1", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
    {"id": "w2", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
    {"id": "after", "type": "TASK", "task": "t", "queue": "fq", "depends_on": ["w1", "w2"]}]}
ONE_WAITER = {"id": "f-one-waiter", "nodes": [{"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go"}]}
TIMER = {"id": "f-timer", "nodes": [
    {"id": "z", "type": "WAIT", "duration_s": 3600},
    {"id": "b", "type": "TASK", "task": "t", "queue": "fq", "depends_on": ["z"]}]}
#: Two tasks at once on a queue the sweep limits to one RUNNING (queue_settings, flow_slots).
LIMITED = {"id": "f-limited", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "queue": "fl"},
    {"id": "b", "type": "TASK", "task": "t", "queue": "fl"}]}
#: A task that must be claimed within 60 s, and tasks of one customer at most one at a time.
PROMPT = {"id": "f-prompt", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "fs",
                                       "timeouts": {"schedule_to_start_s": 60}}]}
KEYED = {"id": "f-keyed", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "fk",
                                     "concurrency": {"key": "$.input.customer", "limit": 1}}]}
MAP = {"id": "f-map", "nodes": [
    {"id": "each", "type": "MAP", "items": "$.input.ids", "task": "t", "queue": "fq", "max_parallel": 2}]}
#: Tasks on a queue of their own, for the cases with an idle worker registered to be woken.
WAITED = {"id": "f-waited", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "queue": "fw"},
    {"id": "b", "type": "TASK", "task": "t", "queue": "fw", "depends_on": ["a"]}]}
KID = {"id": "f-kid", "nodes": [{"id": "k", "type": "TASK", "task": "t", "queue": "fq"}]}
PARENT = {"id": "f-parent", "nodes": [{"id": "call", "type": "SUB_WORKFLOW", "workflow": "f-kid",
                                       "input": {"token": "$.input.token"}}]}
#: f-pruned's webhook goes nowhere: its deliveries stay pending unless a case marks them delivered
NOWHERE = "http://127.0.0.1:9/never"
RELAY = RelayPolicy(lease_s=0.3)


@dataclass
class Rig(Bench):
    """The bench, and the receiver of f-hook's webhooks (it records each run's POSTs)."""

    hook: Hook


@dataclass
class Claimed:
    run_id: str
    claim: Claim


@dataclass(frozen=True)
class WritePath:
    """One write path of the sweep (tests/faults/harness.py :func:`sweep`):
    ``setup(b)`` builds fresh state through the direct engine, ``act(b, state)`` is
    the operation through the proxy, ``check(b, state, result)`` lists what is
    wrong afterwards, ``settle(b, state)`` lets an effect that completes later
    (after a lease, say) finish before the check."""

    name: str
    setup: Callable[[Rig], Any]
    act: Callable[[Rig, Any], Any]
    check: Callable[[Rig, Any, Result], list[str]]
    settle: Callable[[Rig, Any], None] | None = None
    every_request: bool = True      # False: cut at its COMMITs only (harness.sweep)

    @property
    def id(self) -> str:
        """The test ID: the name, each run of other characters one ``_`` (``signal_two_waiters``)."""
        return re.sub(r"[^A-Za-z0-9]+", "_", self.name).strip("_")


# -- reading and building state (through the direct engine) -------------------------------------


def _token() -> str:
    return uuid.uuid4().hex


def _nodes(b: Rig, run_id: str) -> dict[str, tuple[str, int]]:
    return {t.node_id: (t.state, t.attempt) for t in b.direct.get_run(run_id).tasks}


def _outbox(b: Rig, run_id: str) -> list[tuple[str, int]]:
    return [(r[0], r[1]) for r in b.sql(
        "SELECT t.node_id, o.attempt FROM task_outbox o JOIN task_instances t ON t.run_id = o.run_id "
        "AND t.id = o.task_id WHERE o.run_id = %s ORDER BY 1", (run_id,))]


def _partitions(b: Rig) -> set[tuple[str, str]]:
    with b.direct.pool.connection() as conn:
        return {(p.table, p.month) for p in partitions.list_partitions(conn)}


def _cancel_active(b: Rig) -> None:
    """Cancel what earlier cases left active; a child run goes with its parent."""
    for (run_id,) in b.sql("SELECT id FROM workflow_runs WHERE status = 'RUNNING' AND parent_run_id IS NULL"):
        b.direct.cancel(run_id, reason="next case")


def _fresh_run(b: Rig, definition: str) -> str:
    """A run of ``definition`` once what earlier cases left active is cancelled, so a
    claim or a coordinator pass finds only this case's tasks."""
    _cancel_active(b)
    return b.direct.start(definition)


def _claim_one(b: Rig) -> Claim:
    claims = b.direct.claim(["fq"], "w-direct", 1)
    assert len(claims) == 1, claims
    return claims[0]


def _claimed(definition: str, *, lease_over: bool = False) -> Callable[[Rig], Claimed]:
    """Set-up: a fresh run of ``definition`` whose first task the direct engine holds
    (its lease already over, with ``lease_over``)."""
    def setup(b: Rig) -> Claimed:
        run_id = _fresh_run(b, definition)
        claim = _claim_one(b)
        if lease_over:
            expire_leases(b, run_id)
        return Claimed(run_id, claim)
    return setup


def _succeeded(b: Rig, definition: str) -> str:
    """A SUCCEEDED run of a one-waiter definition (its signal sent)."""
    run_id = b.direct.start(definition)
    b.direct.signal(run_id, "go")
    return run_id


def _waiters_and_token(b: Rig) -> tuple[str, str]:
    return b.direct.start("f-two-waiters"), _token()


def _both_waiters_resolved(b: Rig) -> tuple[str, str]:
    """Two signals resolve both waiters (the run then waits on its TASK, still RUNNING):
    the next signal finds no waiter."""
    run_id, token = _waiters_and_token(b)
    b.direct.signal(run_id, "go", payload={"first": 1})
    b.direct.signal(run_id, "go", payload={"second": 2})
    return run_id, token


def _due_timer(b: Rig) -> str:
    run_id = _fresh_run(b, "f-timer")
    make_due(b, run_id)
    return run_id


def _finished_deliveries(b: Rig) -> tuple[list[str], list[str]]:
    """Finished runs of f-pruned: two whose deliveries were sent 9 and 8 days ago, then
    one sent 2 days ago and one finished 9 days ago whose delivery is still pending."""
    def finished(days_ago: int, delivered: bool = True) -> str:
        run_id = _succeeded(b, "f-pruned")
        if delivered:
            b.sql("UPDATE webhook_deliveries SET delivered_at = now() - make_interval(days => %s) WHERE run_id = %s",
                  (days_ago, run_id))
        b.sql("UPDATE workflow_runs SET completed_at = now() - make_interval(days => %s) WHERE id = %s",
              (days_ago, run_id))
        return run_id
    return [finished(9), finished(8)], [finished(2), finished(9, delivered=False)]


# -- checks: what every case must leave -------------------------------------------------------


def _raised(result: Result) -> list[str]:
    return [] if result.error is None else [f"the call raised {type(result.error).__name__}: {result.error}"]


def _applied(result: Result) -> list[str]:
    if result.error is not None:
        return _raised(result)
    outcome = result.value
    if isinstance(outcome, Outcome) and outcome.stale:
        return [f"the call reported its own applied event as stale: {outcome.stale}"]
    return []


def _unexpected(b: Rig, run_id: str, *, tasks: dict[str, tuple[str, int]] | None = None,
                outbox: list[tuple[str, int]] | None = None, status: str | None = None) -> list[str]:
    """What differs of the run's tasks (node -> state, attempt), its dispatches (node,
    attempt) and its status from the given ones (None: not compared)."""
    want = {"tasks": tasks, "outbox": outbox, "run": status}
    read: dict[str, Callable[[], Any]] = {"tasks": lambda: _nodes(b, run_id), "outbox": lambda: _outbox(b, run_id),
                                          "run": lambda: b.direct.get_run(run_id).status}
    got = {what: read[what]() for what, value in want.items() if value is not None}
    if all(got[what] == want[what] for what in got):
        return []
    return [", ".join(f"{what} {got[what]} (expected {want[what]})" for what in got)]


def _leaves(*, tasks: dict[str, tuple[str, int]] | None = None, outbox: list[tuple[str, int]] | None = None,
            status: str | None = None) -> Callable[[Rig, Any, Result], list[str]]:
    """The check of a call that returns an Outcome for one run: applied (nothing
    raised, not stale), and the run's tasks, dispatches and status as given."""
    def check(b: Rig, state: str | Claimed, result: Result) -> list[str]:
        run_id = state if isinstance(state, str) else state.run_id
        return _applied(result) + _unexpected(b, run_id, tasks=tasks, outbox=outbox, status=status)
    return check


def _one_run_started(b: Rig, token: str, result: Result) -> list[str]:
    runs = [r[0] for r in b.sql("SELECT id FROM workflow_runs WHERE input_json->>'token' = %s", (token,))]
    if len(runs) != 1:
        return [f"{len(runs)} runs for one start"] + _raised(result)
    problems = _raised(result)
    if result.error is None and result.value != runs[0]:
        problems.append(f"start returned {result.value}, the run is {runs[0]}")
    return problems + _unexpected(b, runs[0], tasks={"a": ("PENDING", 0)}, outbox=[("a", 0)])


def _idle_waiter(b: Rig, *, cancel: bool = True) -> str:
    """A worker registered as idle on queue fw with room for one task (its empty claim,
    once what earlier cases left active is cancelled), through the direct engine."""
    if cancel:
        _cancel_active(b)
    worker = f"w-idle-{_token()[:8]}"
    assert b.direct.claim(["fw"], worker, 1, wake=outbox.wake_channel(worker), seen=0) == []
    return worker


def _handed_out(b: Rig, worker: str) -> int:
    """The wake-ups dispatches handed to ``worker`` (task_waiters.promised)."""
    return int(b.sql("SELECT promised FROM task_waiters WHERE worker = %s", (worker,))[0][0])


def _waited_start(b: Rig) -> tuple[str, str]:
    return _token(), _idle_waiter(b)


def _one_run_started_and_handed_out_once(b: Rig, s: tuple[str, str], result: Result) -> list[str]:
    """A start retried after a lost acknowledgement finds its run: its one dispatch hands
    the idle worker one wake-up, not one per attempt."""
    token, worker = s
    runs = [r[0] for r in b.sql("SELECT id FROM workflow_runs WHERE input_json->>'token' = %s", (token,))]
    if len(runs) != 1:
        return [f"{len(runs)} runs for one start"] + _raised(result)
    handed = _handed_out(b, worker)
    return (_raised(result) + _unexpected(b, runs[0], tasks={"a": ("PENDING", 0)}, outbox=[("a", 0)])
            + ([] if handed == 1 else [f"{handed} wake-ups handed to the idle worker for one task"]))


@dataclass
class ClaimedWaited(Claimed):
    worker: str


def _waited_claimed(b: Rig) -> ClaimedWaited:
    """A fresh f-waited run whose first task the direct engine holds, and an idle worker
    registered on its queue."""
    run_id = _fresh_run(b, "f-waited")
    claims = b.direct.claim(["fw"], "w-direct", 1)
    assert len(claims) == 1, claims
    return ClaimedWaited(run_id=run_id, claim=claims[0], worker=_idle_waiter(b, cancel=False))


def _completed_and_handed_out_once(b: Rig, s: ClaimedWaited, result: Result) -> list[str]:
    handed = _handed_out(b, s.worker)
    return (_leaves(tasks={"a": ("COMPLETED", 0), "b": ("PENDING", 0)}, outbox=[("b", 0)])(b, s, result)
            + ([] if handed == 1 else [f"{handed} wake-ups handed to the idle worker for one task"]))


def _items(b: Rig, run_id: str) -> tuple[list[tuple[int, str]], list[int], tuple[Any, ...]]:
    """A MAP run's items (index, state), the dispatched ones (index), and the node's counters."""
    items = [(int(i), str(st)) for i, st in b.sql(
        "SELECT item_index, state FROM task_instances WHERE run_id = %s AND item_index IS NOT NULL "
        "ORDER BY item_index", (run_id,))]
    sent = [int(r[0]) for r in b.sql(
        "SELECT t.item_index FROM task_outbox o JOIN task_instances t ON t.run_id = o.run_id AND t.id = o.task_id "
        "WHERE o.run_id = %s ORDER BY 1", (run_id,))]
    counters = tuple(b.sql("SELECT items_total, items_started, items_done, items_failed FROM task_instances "
                           "WHERE run_id = %s AND node_id = 'each' AND item_index IS NULL", (run_id,))[0])
    return items, sent, counters


def _one_map_run_started(b: Rig, token: str, result: Result) -> list[str]:
    runs = [r[0] for r in b.sql("SELECT id FROM workflow_runs WHERE input_json->>'token' = %s", (token,))]
    if len(runs) != 1:
        return [f"{len(runs)} runs for one start"] + _raised(result)
    got = _items(b, runs[0])
    want = ([(0, "PENDING"), (1, "PENDING"), (2, "PENDING")], [0, 1], (3, 2, 0, 0))
    return _raised(result) + ([] if got == want else [f"items, dispatches, counters {got}, not {want}"])


def _map_item_claimed(b: Rig) -> Claimed:
    _cancel_active(b)
    run_id = b.direct.start("f-map", input={"ids": ["x", "y", "z"]})
    claims = b.direct.claim(["fq"], "w-direct", 1)
    assert len(claims) == 1 and claims[0].input["index"] == 0, claims
    return Claimed(run_id, claims[0])


def _item_completed_once(b: Rig, state: Claimed, result: Result) -> list[str]:
    """One item completed, counted once, and the third item dispatched once."""
    got = _items(b, state.run_id)
    want = ([(0, "COMPLETED"), (1, "PENDING"), (2, "PENDING")], [1, 2], (3, 3, 1, 0))
    return _applied(result) + ([] if got == want else [f"items, dispatches, counters {got}, not {want}"])


def _children(b: Rig, parent: str) -> list[tuple[str, str]]:
    return [(str(r[0]), str(r[1])) for r in b.sql(
        "SELECT id, status FROM workflow_runs WHERE parent_run_id = %s ORDER BY id", (parent,))]


def _one_parent_one_child(b: Rig, token: str, result: Result) -> list[str]:
    runs = [r[0] for r in b.sql("SELECT id FROM workflow_runs WHERE input_json->>'token' = %s "
                                "AND parent_run_id IS NULL", (token,))]
    if len(runs) != 1:
        return [f"{len(runs)} parent runs for one start"] + _raised(result)
    kids = _children(b, runs[0])
    return _raised(result) + ([] if [st for _, st in kids] == ["RUNNING"] else [f"children {kids}"])


def _parent_started(b: Rig) -> str:
    _cancel_active(b)
    return b.direct.start("f-parent", input={"token": _token()})


def _parent_and_child_cancelled(b: Rig, parent: str, result: Result) -> list[str]:
    problems = _applied(result)
    if b.direct.get_run(parent).status != "CANCELLED":
        problems.append(f"the parent is {b.direct.get_run(parent).status}")
    kids = _children(b, parent)
    if [st for _, st in kids] != ["CANCELLED"]:
        problems.append(f"children {kids}")
    return problems


def _child_start_row(b: Rig) -> str:
    """A parent whose decision wrote its child's start as a row (what it does on Citus,
    engine/childrows.py), not delivered: the coordinator's children loop is to start it."""
    _cancel_active(b)
    shell = b.direct.shell
    shell._citus = True          # the row path, on this single server
    try:
        return b.direct._start("f-parent", {"token": _token()}, None, None, [], Request())
    finally:
        shell._citus = None
        shell.take_deliveries()


def _children_delivered(b: Rig, _: str) -> None:
    b.direct.coordinator().run_once(["children"])


def _child_started_once(b: Rig, parent: str, result: Result) -> list[str]:
    problems = _raised(result)
    kids = _children(b, parent)
    if [st for _, st in kids] != ["RUNNING"]:
        problems.append(f"children {kids}")
    else:
        started = b.sql("SELECT count(*) FROM run_history WHERE run_id = %s AND kind = 'started'", (kids[0][0],))
        if started[0][0] != 1:
            problems.append(f"the child was started {started[0][0]} times")
    left = b.sql("SELECT kind FROM child_deliveries WHERE run_id = %s", (parent,))
    if left:
        problems.append(f"rows left {left}")
    return problems


def _child_task_claimed(b: Rig) -> Claimed:
    parent = _parent_started(b)
    return Claimed(parent, _claim_one(b))


def _parent_completed_by_child(b: Rig, state: Claimed, result: Result) -> list[str]:
    problems = _applied(result)
    if [st for _, st in _children(b, state.run_id)] != ["SUCCEEDED"]:
        problems.append(f"children {_children(b, state.run_id)}")
    if b.direct.get_run(state.run_id).status != "SUCCEEDED":
        problems.append(f"the parent is {b.direct.get_run(state.run_id).status}")
    return problems


def _the_client_run_id_returned(b: Rig, run_id: str, result: Result) -> list[str]:
    """The client's run ID is its idempotency key: a retry after a lost acknowledgement
    must return the run it started, not Conflict."""
    n = b.sql("SELECT count(*) FROM workflow_runs WHERE id = %s", (run_id,))[0][0]
    problems = [] if n == 1 else [f"{n} runs"]
    if result.error is not None or result.value != run_id:
        problems.append(f"start returned {result.value!r} / raised {result.error!r}, not the run ID")
    return problems


def _signal_token(b: Rig, state: tuple[str, str]) -> Any:
    run_id, token = state
    return b.engine.signal(run_id, "go", payload={"token": token})


def _resolved_or_buffered_once(b: Rig, state: tuple[str, str], result: Result) -> list[str]:
    run_id, token = state
    resolved = [t.node_id for t in b.direct.get_run(run_id).tasks if t.output == {"token": token}]
    buffered = b.sql("SELECT count(*) FROM workflow_events WHERE run_id = %s", (run_id,))[0][0]
    problems = _applied(result)
    if len(resolved) + buffered != 1:
        problems.append(f"one signal resolved {resolved} and was buffered {buffered} times")
    return problems


def _buffered_once(b: Rig, state: tuple[str, str], result: Result) -> list[str]:
    rows = b.sql("SELECT count(*) FROM workflow_events WHERE run_id = %s AND payload->>'token' = %s", state)[0][0]
    return _applied(result) + ([] if rows == 1 else [f"the signal was buffered {rows} times"])


def _two_ready(b: Rig) -> tuple[str, str]:
    """A fresh run whose first task a claim takes, and a second run whose task is ready
    behind it: the claim asks for one, so a first attempt that reaches the server after
    its retry committed has a task to take, which no caller would hear of."""
    run_id = _fresh_run(b, "f-chain")
    return run_id, b.direct.start("f-chain")


def _claimed_by_its_holder(b: Rig, state: tuple[str, str], result: Result) -> list[str]:
    """Whatever the claim returns, the task must end up run exactly by an attempt
    that holds it, and the run must go on: a claim whose acknowledgement was lost
    leaves the task leased to nobody, which the lease sweeper must re-queue without
    counting it as a failed attempt (the default policy allows one attempt). No task is
    leased to the caller but those the claim returned (a held first attempt that
    reached the server after its retry committed must take nothing)."""
    run_id, other = state
    problems = _raised(result)
    claims = result.value or []
    leased = set(b.sql("SELECT run_id, id FROM task_instances WHERE state = 'RUNNING' AND lease_owner = 'w-proxied'"))
    if leased - {(c.run_id, c.task_id) for c in claims}:
        problems.append(f"tasks leased to the caller that the claim did not return: "
                        f"{sorted(leased - {(c.run_id, c.task_id) for c in claims})}")
    b.direct.cancel(other, reason="case done")
    for c in claims:
        row = b.sql("SELECT state, attempt, lease_owner FROM task_instances WHERE run_id = %s AND id = %s",
                    (c.run_id, c.task_id))[0]
        if row != ("RUNNING", c.attempt, "w-proxied"):
            problems.append(f"the claim returned attempt {c.attempt} but the task is {row}: "
                            "a handler would run an attempt it does not hold")
    if not claims:
        if result.error is None:
            # A claim that says it took nothing must not have taken it: a retry that looked
            # while its first attempt was still committing, then returned [], left the task
            # leased to a worker that was never told (issue 31, item 5).
            row = b.sql("SELECT state, lease_owner FROM task_instances WHERE run_id = %s AND node_id = 'a'",
                        (run_id,))[0]
            if row == ("RUNNING", "w-proxied"):
                problems.append("the claim returned nothing, but the task is RUNNING leased to its caller")
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


def _completed_and_next_claimed_once(b: Rig, s: Claimed, result: Result) -> list[str]:
    """A completion that claims the next tasks in its transaction (``claim_next``): task
    a COMPLETED once, and its successor b, dispatched by the same write, claimed by it
    once, leased to the claim's owner at attempt 0 and returned as ``Outcome.claimed``,
    whatever was cut (a retry that finds the completion applied returns what its claim
    took); no other task leased to that owner."""
    problems = _applied(result)
    claimed = list(result.value.claimed or []) if isinstance(result.value, Outcome) else []
    if result.error is None and [c.node_id for c in claimed] != ["b"]:
        problems.append(f"the completion's claim returned {[c.node_id for c in claimed]}, not ['b']")
    leased = set(b.sql("SELECT run_id, id FROM task_instances WHERE state = 'RUNNING' AND lease_owner = 'w-proxied'"))
    if leased != {(c.run_id, c.task_id) for c in claimed}:
        problems.append(f"tasks leased to the claim's owner {sorted(leased)}, returned "
                        f"{sorted((c.run_id, c.task_id) for c in claimed)}")
    nodes = _nodes(b, s.run_id)
    if nodes != {"a": ("COMPLETED", 0), "b": ("RUNNING", 0)}:
        problems.append(f"tasks {nodes}, not a COMPLETED and b RUNNING, each at attempt 0")
    notes = b.sql("SELECT count(*) FROM run_history WHERE run_id = %s AND kind = 'claimed' AND node_id = 'b'",
                  (s.run_id,))[0][0]
    if notes != 1:
        problems.append(f"{notes} 'claimed' history rows for b, not 1")
    return problems


def _limit_kept(b: Rig, run_id: str, result: Result) -> list[str]:
    """A claim on a queue limited to one RUNNING task: whatever was cut, one place at
    most is taken, by exactly the task RUNNING; once that task completes (claimed again
    after its lease when the claim's answer was lost) the place is free and the other
    task can be claimed."""
    problems = _raised(result)

    def counts() -> tuple[int, int]:
        slots = b.sql("SELECT count(*) FROM flow_slots WHERE key = 'queue:fl'")[0][0]
        running = b.sql("SELECT count(*) FROM task_instances WHERE run_id = %s AND state = 'RUNNING'", (run_id,))[0][0]
        return int(slots), int(running)

    slots, running = counts()
    if running > 1 or slots != running:
        problems.append(f"{running} task(s) RUNNING and {slots} place(s) taken under a limit of 1")
    claims = result.value or []
    if not claims:
        expire_leases(b, run_id)
        b.direct.coordinator().run_once(TIMERS_AND_LEASES)
        claims = b.direct.claim(["fl"], "w-direct", 2)
    if len(claims) != 1:
        return problems + [f"expected one task claimable under the limit, got {len(claims)}"]
    b.direct.complete(claims[0], {"ok": True})
    if counts() != (0, 0):
        problems.append(f"after completing the task: places and RUNNING {counts()}")
    if len(b.direct.claim(["fl"], "w-direct", 2)) != 1:
        problems.append("the other task was not claimable once the place was free")
    return problems


def _one_per_key(b: Rig, runs: list[str], result: Result) -> list[str]:
    """A claim of two tasks sharing a key limited to 1: one RUNNING at most and its place
    taken, whatever was cut; once it completes, the other is claimable."""
    problems = _raised(result)
    running = b.sql("SELECT count(*) FROM task_instances WHERE run_id = ANY(%s) AND state = 'RUNNING'", (runs,))
    slots = b.sql("SELECT count(*) FROM flow_slots WHERE run_id = ANY(%s)", (runs,))
    if running[0][0] > 1 or running != slots:
        problems.append(f"{running[0][0]} RUNNING and {slots[0][0]} place(s) for a key limited to 1")
    claims = result.value or []
    if not claims:
        for run_id in runs:
            expire_leases(b, run_id)
        b.direct.coordinator().run_once(TIMERS_AND_LEASES)
        claims = b.direct.claim(["fk"], "w-direct", 2)
    if len(claims) != 1:
        return problems + [f"expected one task of the key claimable, got {len(claims)}"]
    b.direct.complete(claims[0], None)
    if len(b.direct.claim(["fk"], "w-direct", 2)) != 1:
        problems.append("the key's other task was not claimable once the first completed")
    return problems


def _failed_unstarted_once(b: Rig, run_id: str, result: Result) -> list[str]:
    """The task not claimed in time FAILED once, naming the timeout, and its run with it.
    A pass cut before it handled the dispatch leaves it to the next pass: run one."""
    problems = _raised(result)
    if _nodes(b, run_id)["a"][0] == "PENDING":
        b.direct.coordinator().run_once(TIMERS_AND_LEASES)
    rows = b.sql("SELECT state, attempt, last_error->>'error' FROM task_instances WHERE run_id = %s", (run_id,))
    if len(rows) != 1 or rows[0][:2] != ("FAILED", 0) or "schedule_to_start timeout" not in str(rows[0][2]):
        problems.append(f"task {rows}")
    failed = b.sql("SELECT count(*) FROM run_history WHERE run_id = %s AND kind = 'failed'", (run_id,))
    if failed != [(1,)]:
        problems.append(f"{failed[0][0]} 'failed' history rows")
    if b.direct.get_run(run_id).status != "FAILED" or _outbox(b, run_id):
        problems.append(f"run {b.direct.get_run(run_id).status}, outbox {_outbox(b, run_id)}")
    return problems


def _queue_changed_once(action: str, expected: tuple[bool, int]) -> Callable[[Rig, str, Result], list[str]]:
    """The queue's settings are as asked and one audit row says so, however often the
    change was retried."""
    def check(b: Rig, queue: str, result: Result) -> list[str]:
        problems = _raised(result)
        row = b.sql("SELECT paused, max_running FROM queue_settings WHERE queue = %s", (queue,))
        if row != [expected]:
            problems.append(f"queue {queue} settings {row}, expected {expected}")
        audits = b.sql("SELECT count(*) FROM operator_audit WHERE action = %s AND target = %s", (action, queue))
        if audits != [(1,)]:
            problems.append(f"{audits[0][0]} audit rows for one {action}")
        return problems
    return check


def _lease_still_held(b: Rig, s: Claimed, result: Result) -> list[str]:
    problems = _raised(result)
    if result.error is None and result.value is None:
        problems.append("the heartbeat reported a lease it still holds as lost")
    row = b.sql("SELECT state, lease_owner, lease_expires_at > %s FROM task_instances "
                "WHERE run_id = %s AND id = %s", (s.claim.lease_expires_at, s.run_id, s.claim.task_id))[0]
    if row[:2] != ("RUNNING", "w-direct"):
        problems.append(f"the heartbeat changed the task: {row}")
    return problems


def _timer_fired(b: Rig, run_id: str, result: Result) -> list[str]:
    """A pass cut by a fault leaves the timer for the next pass: run one."""
    not_fired = partial(_unexpected, b, run_id, tasks={"z": ("COMPLETED", 0), "b": ("PENDING", 0)}, outbox=[("b", 0)])
    if not_fired():
        b.direct.coordinator().run_once(TIMERS_AND_LEASES)
    return _raised(result) + not_fired()


def _requeued_once(b: Rig, s: Claimed, result: Result) -> list[str]:
    """One expiry counted: attempt 1 pending with one dispatch, and the run goes on (a
    lease expiry is not a handler failure, under any policy). A pass cut before the
    sweep leaves the task to the next pass: run one."""
    if _nodes(b, s.run_id)["a"] == ("RUNNING", 0):
        b.direct.coordinator().run_once(TIMERS_AND_LEASES)
    return _raised(result) + _unexpected(b, s.run_id, tasks={"a": ("PENDING", 1)}, outbox=[("a", 1)],
                                         status="RUNNING")


def _posted_once(b: Rig, run_id: str, result: Result) -> list[str]:
    """Whatever the connection fault, the delivery is POSTed exactly once and recorded."""
    row = b.sql("SELECT delivered_at IS NOT NULL, attempts FROM webhook_deliveries WHERE run_id = %s", (run_id,))
    posts = b.hook.received.get(run_id, [])
    problems = _raised(result)
    if not row or not row[0][0]:
        problems.append(f"the delivery was not recorded as delivered: {row}")
    if posts != ["SUCCEEDED"]:
        # connection faults cost no duplicate: a POST is repeated only when the relay
        # dies between it and its record (the chaos run counts those)
        problems.append(f"the receiver got {posts}")
    return problems


def _old_deliveries_pruned(b: Rig, state: tuple[list[str], list[str]], result: Result) -> list[str]:
    """Deliveries finished more than the kept days ago go, all of them, whatever the
    fault (a retried batch deletes what is left); younger and pending ones stay."""
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


def _months_created(b: Rig, months: list[str], result: Result) -> list[str]:
    """A cut pass leaves upkeep to the next one (it is retried on every pass until it
    succeeds): run one."""
    def missing() -> list[tuple[str, str]]:
        have = _partitions(b)
        return [(t, m) for t in RUN_TABLES for m in months if (t, m) not in have]
    if missing():
        b.direct.coordinator(months_ahead=5).run_once(["partitions"])
    left = missing()
    return _raised(result) + ([f"partitions missing after upkeep: {left}"] if left else [])


def _only_that_month_dropped(b: Rig, keep: str, result: Result) -> list[str]:
    """The month is dropped exactly when the plan says so, the report names it even
    when the acknowledgement of the drop was lost, and no other month is touched."""
    problems = _raised(result)
    if result.error is None and result.value.dropped != ["202001"]:
        problems.append(f"the drop reported {result.value.dropped}, not the month it dropped")
    if "202001" in {month for _, month in _partitions(b)}:
        problems.append("the month is still there")
    if b.direct.get_run(keep).status != "RUNNING":
        problems.append("a run of another month changed")
    return problems


def _deleted_once(b: Rig, run_id: str, result: Result) -> list[str]:
    """A delete retried after a lost acknowledgement returns what its lost attempt did."""
    problems = _raised(result)
    row = b.sql("SELECT status, deleted_at IS NOT NULL FROM workflow_runs WHERE id = %s", (run_id,))
    if row != [("SUCCEEDED", True)]:
        problems.append(f"after one delete the run is {row}")
    if result.error is None and result.value.already:
        problems.append("the delete reported the run as deleted before it: its own lost attempt")
    return problems


def _reopened_once(b: Rig, run_id: str, result: Result) -> list[str]:
    """A retry from a node retried after a lost acknowledgement returns what its lost
    attempt did, and the run is reopened once: one new task, one dispatch, one audit row."""
    problems = _raised(result)
    if result.error is None and not (result.value.applied and result.value.reset == ("a",)):
        problems.append(f"the retry returned {result.value}")
    problems += _unexpected(b, run_id, tasks={"a": ("PENDING", 0)}, outbox=[("a", 0)], status="RUNNING")
    audits = b.sql("SELECT count(*) FROM operator_audit WHERE action = 'runs retry' AND target = %s", (run_id,))
    if audits != [(1,)]:
        problems.append(f"audit rows {audits}")
    return problems


def _cancelled_once_each(b: Rig, s: tuple[str, list[str]], result: Result) -> list[str]:
    """A bulk cancel whose chunk loses its acknowledgement finds the chunk's audit row on
    retry: every selected run is cancelled once and reported once, one audit row a chunk."""
    _, started = s
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


