"""The real engine on a real database against the pure state machine, step by step.

A hypothesis ``RuleBasedStateMachine`` starts runs of a few workflows and interleaves,
at random, what clients, workers and coordinators do: claim, complete, fail (retryable
or not), heartbeat, signal, cancel, lease expiry and timers coming due (the database
clock is not ours to move, so the expiry instants are moved, in the tables and in the
model alike), lease-sweeper and timer passes. Any step may be hit by a connection
fault (tests/faults/harness.py's proxy): the connection dropped before one of its
requests, a request's acknowledgement lost after the server completed it (a COMMIT
that committed), or a request held back while the step's retry starts (the first
attempt still committing, or, for the claim's one statement, not yet on the server).
The engine must ride through it: every step's outcome, and after it every run, must
equal what the pure machine decides when each event is applied once.

The model is :class:`composer_ops.simulate.replay.Replay`, one per run: the machine's
decisions applied to in-memory rows with the repository's fences. Compared after each
step: each run's status, each node's state and attempt, the buffered signals, the
outcome of the step (applied, stale, or the error a client gets), plus the engine-wide
invariants of the harness.

``COMPOSER_STATEFUL_EXAMPLES`` (default 12) and ``COMPOSER_STATEFUL_STEPS`` (40) size
it (``make chaos`` runs 30 of 60); ``COMPOSER_STATEFUL_FAULTS=0`` runs the same
interleavings without connection faults.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from composer_ops import ComposerError, Conflict, Invalid
from composer_ops.core.model import (
    CancelRun,
    Decision,
    LeaseExpired,
    RunStatus,
    SignalReceived,
    StartRun,
    TaskCompleted,
    TaskFailed,
    TaskRef,
    TaskState,
    TimerDue,
)
from composer_ops.core.spec import WorkflowSpec, parse_spec
from composer_ops.engine.shell import Outcome
from composer_ops.repo.rows import Claim
from composer_ops.simulate.replay import Replay
from composer_ops.testing.faultproxy import Fault
from composer_ops.testing.servers import Server
from tests.faults.harness import Bench, bench, invariant_problems

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES = int(os.environ.get("COMPOSER_STATEFUL_EXAMPLES", "12"))
FAULTS = os.environ.get("COMPOSER_STATEFUL_FAULTS", "1") != "0"   # 0: the same interleavings, no faults
STEPS = int(os.environ.get("COMPOSER_STATEFUL_STEPS", "40"))
T0 = datetime(2030, 1, 1, tzinfo=UTC)      # the model's clock: leases and wake-ups are relative to it
QUEUE = "sq"
RETRY = {"max_attempts": 3, "initial_backoff_s": 0, "multiplier": 1, "max_backoff_s": 0}
#: Every lease outlasts any example: a lease lapses only when the test says so
#: (``lease_lapses``). A lease of the default 30 s can lapse by the wall clock in a slow
#: example (a loaded machine, held requests), which the model never hears of: the
#: database then expires or refuses what the model still holds, and a faster replay of
#: the same example does not.
LEASE: dict[str, Any] = {"lease_s": 3600}

SPECS: dict[str, dict[str, Any]] = {
    "st-chain": {"id": "st-chain", "nodes": [
        {"id": "a", "type": "TASK", "task": "t", "queue": QUEUE, "retry": RETRY, **LEASE},
        {"id": "b", "type": "TASK", "task": "t", "queue": QUEUE, "depends_on": ["a"], **LEASE}]},
    "st-switch": {"id": "st-switch", "nodes": [
        {"id": "a", "type": "TASK", "task": "t", "queue": QUEUE, **LEASE},
        {"id": "s", "type": "SWITCH", "depends_on": ["a"], "expression": "$.nodes.a.output.k",
         "cases": {"x": ["b"]}, "default": ["c"]},
        {"id": "b", "type": "TASK", "task": "t", "queue": QUEUE, "depends_on": ["s"], **LEASE},
        {"id": "c", "type": "TASK", "task": "t", "queue": QUEUE, "depends_on": ["s"], "retry": RETRY, **LEASE},
        {"id": "j", "type": "TASK", "task": "t", "queue": QUEUE, "depends_on": ["b", "c"], **LEASE}]},
    "st-signals": {"id": "st-signals", "nodes": [
        {"id": "w1", "type": "WAIT_FOR_SIGNAL", "signal": "go", "timeout_s": 3600, "on_timeout": "continue"},
        {"id": "w2", "type": "WAIT_FOR_SIGNAL", "signal": "go", "timeout_s": 3600},
        {"id": "j", "type": "TASK", "task": "t", "queue": QUEUE, "depends_on": ["w1", "w2"], **LEASE}]},
    "st-late": {"id": "st-late", "nodes": [
        {"id": "a", "type": "TASK", "task": "t", "queue": QUEUE, **LEASE},
        {"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["a"]},
        {"id": "z", "type": "WAIT", "duration_s": 3600, "depends_on": ["w"]}]},
}
PARSED: dict[str, WorkflowSpec] = {k: parse_spec(v) for k, v in SPECS.items()}
#: what the run did, by step and outcome, and the faults that fired (written to TALLY)
T = TypeVar("T")

TALLY = Path(__file__).resolve().parents[2] / ".pytest_cache" / "composer-stateful.json"
COUNTS: Counter[str] = Counter()

#: a connection fault on a step: none, or (fault, request number); request numbers past
#: the step's last request inject nothing
STEP_FAULTS = [Fault.DROP_BEFORE, Fault.LOSE_ACK, Fault.HOLD_COMMIT]
faults = st.one_of(st.just(None), st.tuples(st.sampled_from(STEP_FAULTS), st.integers(1, 8))) \
    if FAULTS else st.just(None)
#: The claim gets every fault too, at its one request (its statement; a retry's requests
#: come only after a fault fired): a held claim statement reaches the server only once
#: its retry has committed, and must then take nothing (the retry fenced its claim ID off).
claim_faults = st.one_of(st.just(None), st.tuples(st.sampled_from(STEP_FAULTS), st.just(1))) \
    if FAULTS else st.just(None)


@dataclass
class Held:
    """A claim a worker holds, and the run it belongs to."""

    claim: Claim
    run_id: str


@pytest.fixture(scope="module")
def b(server: Server, template_db: str) -> Iterator[Bench]:
    with server.database(template=template_db) as url, bench(url) as fb:
        for spec in SPECS.values():
            fb.direct.deploy(spec)
        yield fb


def _outcome(result: Any) -> str:
    """A step's result as a client sees it: applied, stale, or the error's class."""
    if isinstance(result, datetime):
        return "lease extended"
    if isinstance(result, str):
        return "started"
    if isinstance(result, BaseException):
        return type(result).__name__
    if isinstance(result, Outcome):
        return "stale" if result.stale else "applied"
    if isinstance(result, Decision):
        if getattr(result, "refused", None):   # applied what came due, then refused the event
            return "Conflict"
        return "stale" if result.stale else "applied"
    return repr(result)


def test_the_engine_under_faults_does_what_the_machine_decides(b: Bench) -> None:
    class EngineAgainstMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.models: dict[str, Replay] = {}
            self.held: list[Held] = []
            self.coordinator = b.engine.coordinator()
            self.steps: list[str] = []

        # -- plumbing ------------------------------------------------------------------

        @initialize()
        def empty(self) -> None:
            b.sql("TRUNCATE workflow_runs, task_instances, task_outbox, webhook_deliveries CASCADE")

        def faulted(self, fault: tuple[Fault, int] | None, call: Callable[[], Any], what: str) -> Any:
            """Run a step through the proxy, with its fault armed; returns its result or the
            ComposerError a client would get."""
            b.proxy.reset()
            if fault is not None:
                b.proxy.arm(fault[0], at=fault[1])
            result: Any = None
            try:
                result = call()
                return result
            except ComposerError as exc:
                result = exc
                return exc
            finally:
                b.proxy.disarm()
                b.proxy.release()        # a held request the step's retry never waited for
                assert b.proxy.wait_released(60), "a held request was never answered"
                fired = b.proxy.fired
                self.steps.append(f"{what}" + (f" [{fault[0]} at {fired}]" if fault and fired else ""))
                shown = f"claimed {len(result)}" if isinstance(result, list) else _outcome(result)
                COUNTS[f"step {what.split()[0]}: {shown}"] += 1
                if fault and fired:
                    COUNTS[f"fault {fault[0]}{' at a COMMIT' if fired.text == 'COMMIT' else ''}"] += 1
                    COUNTS[f"fault {fault[0]} in a {what.split()[0]}"] += 1

        def model_send(self, run_id: str, event: Any) -> Any:
            try:
                return self.models[run_id].send(event)
            except (Conflict, Invalid) as exc:
                return exc

        def ref(self, held: Held) -> TaskRef:
            """The claim as the model knows it (the model mints its own task IDs)."""
            c = held.claim
            return TaskRef(task_id=self.models[c.run_id].rows[c.node_id].task_id, run_id=c.run_id,
                           node_id=c.node_id, attempt=c.attempt, lease_owner=c.lease_owner)

        def expect_same(self, what: str, got: Any, want: Any) -> None:
            assert _outcome(got) == _outcome(want), (
                f"{what}: the engine answered {_outcome(got)} ({got!r}), the machine {_outcome(want)} ({want!r})\n"
                + "\n".join(self.steps[-15:]))

        # -- clients --------------------------------------------------------------------

        # Runs are listed in the order the test started them, never sorted by run ID: the
        # engine mints the IDs, and two minted within one millisecond sort either way.
        def active(self) -> list[str]:
            return [r for r, m in self.models.items() if m.status in (RunStatus.RUNNING, RunStatus.PENDING)]

        def ready(self) -> list[tuple[str, str]]:
            """The dispatched tasks a claim may take, (run, node), in the model's order:
            runs as started, nodes as the spec lists them."""
            return [(r, n) for r, m in self.models.items() for n, row in m.rows.items()
                    if row.state is TaskState.PENDING and row.available_at is not None]

        def claimable(self) -> bool:
            return bool(self.ready())

        @precondition(lambda self: len(self.active()) < 4)
        @rule(workflow=st.sampled_from(sorted(SPECS)), k=st.sampled_from(["x", "y"]), fault=faults)
        def start(self, workflow: str, k: str, fault: tuple[Fault, int] | None) -> None:
            run_id = self.faulted(fault, lambda: b.engine.start(workflow, input={"k": k}), f"start {workflow}")
            assert isinstance(run_id, str), f"start failed: {run_id!r}"
            model = Replay(PARSED[workflow], run_id=run_id, input={"k": k}, now=T0)
            model.send(StartRun(now=T0))
            self.models[run_id] = model

        @precondition(lambda self: self.models)
        @rule(data=st.data(), fault=faults)
        def signal(self, data: st.DataObject, fault: tuple[Fault, int] | None) -> None:
            waiting = [r for r in self.active() if self.models[r].spec.id in ("st-signals", "st-late")]
            run_id = _pick(data, waiting or list(self.models))
            payload = {"n": len(self.steps)}
            got = self.faulted(fault, lambda: b.engine.signal(run_id, "go", payload=payload), f"signal {run_id}")
            want = self.model_send(run_id, SignalReceived(name="go", payload=payload, now=T0))
            self.expect_same(f"signal {run_id}", got, want)

        @precondition(lambda self: self.models)
        @rule(data=st.data(), fault=faults)
        def cancel(self, data: st.DataObject, fault: tuple[Fault, int] | None) -> None:
            if data.draw(st.integers(0, 3)):   # a quarter of the time: runs should get somewhere first
                return
            run_id = _pick(data, self.active() or list(self.models))
            got = self.faulted(fault, lambda: b.engine.cancel(run_id, reason="test"), f"cancel {run_id}")
            want = self.model_send(run_id, CancelRun(reason="test", now=T0))
            self.expect_same(f"cancel {run_id}", got, want)

        # -- workers --------------------------------------------------------------------

        @precondition(lambda self: self.claimable())
        @rule(owner=st.sampled_from(["w1", "w2"]), fault=claim_faults)
        def claim(self, owner: str, fault: tuple[Fault, int] | None) -> None:
            # The claim takes the oldest dispatch, and which of several is oldest is the
            # database's business (the instants of their transactions): the model must not
            # follow it, or what is held, and so which rules apply, would differ between
            # two runs of one example. The model says which task is next; the dispatches
            # are aged in that order, and the claim must take that task.
            ready = self.ready()
            b.sql("""UPDATE task_outbox o SET available_at = now() - interval '1 hour' + p.rank * interval '1 ms'
                       FROM task_instances t,
                            unnest(%s::text[], %s::text[]) WITH ORDINALITY AS p(run_id, node_id, rank)
                      WHERE t.run_id = p.run_id AND t.node_id = p.node_id
                        AND o.run_id = t.run_id AND o.task_id = t.id""",
                  ([r for r, _ in ready], [n for _, n in ready]))
            got = self.faulted(fault, lambda: b.engine.claim([QUEUE], owner, 1), f"claim {owner}")
            assert isinstance(got, list), f"claim failed: {got!r}"
            if [(c.run_id, c.node_id) for c in got] not in ([], ready[:1]):
                claims = b.sql("SELECT run_id, task_id, attempt, worker, request, at FROM run_history "
                               "WHERE kind = 'claimed' AND run_id = ANY(%s) ORDER BY at",
                               ([c.run_id for c in got],))
                raise AssertionError(f"the claim took {got}, the model's next task is {ready[0]}; "
                                     f"their claims: {claims}\n" + "\n".join(self.steps[-15:]))
            for c in got:
                model = self.models[c.run_id]
                row = model.rows[c.node_id]
                assert row.attempt == c.attempt, (c, row)
                model.claim(c.node_id, owner)
                self.held.append(Held(c, c.run_id))
            # nothing claimable is left behind in the model that the database would have given
            if not got:
                assert not ready, f"the claim found nothing, the model has {ready}\n" + "\n".join(self.steps[-15:])

        @precondition(lambda self: self.held)
        @rule(data=st.data(), output=st.sampled_from([{"k": "x"}, {"k": "y"}, None]), fault=faults)
        def complete(self, data: st.DataObject, output: Any, fault: tuple[Fault, int] | None) -> None:
            held = _pick(data, self.held)
            got = self.faulted(fault, lambda: b.engine.complete(held.claim, output), f"complete {held.claim.node_id}")
            want = self.model_send(held.run_id, TaskCompleted(ref=self.ref(held), output=output, now=T0))
            self.expect_same(f"complete {held.claim.node_id} of {held.run_id}", got, want)
            self.held.remove(held)

        @precondition(lambda self: self.held)
        @rule(data=st.data(), retryable=st.booleans(), fault=faults)
        def fail(self, data: st.DataObject, retryable: bool, fault: tuple[Fault, int] | None) -> None:
            held = _pick(data, self.held)
            got = self.faulted(fault, lambda: b.engine.fail(held.claim, "boom", retryable=retryable),
                               f"fail {held.claim.node_id}")
            want = self.model_send(held.run_id, TaskFailed(ref=self.ref(held), error="boom", retryable=retryable,
                                                           now=T0))
            self.expect_same(f"fail {held.claim.node_id} of {held.run_id}", got, want)
            self.held.remove(held)

        @precondition(lambda self: self.held)
        @rule(data=st.data(), fault=faults)
        def heartbeat(self, data: st.DataObject, fault: tuple[Fault, int] | None) -> None:
            held = _pick(data, self.held)
            got = self.faulted(fault, lambda: b.engine.heartbeat(held.claim), f"heartbeat {held.claim.node_id}")
            model = self.models[held.run_id]
            row = model.rows[held.claim.node_id]
            want = row.attempt == held.claim.attempt and model.heartbeat(held.claim.node_id, held.claim.lease_owner)
            assert (got is not None and not isinstance(got, BaseException)) == want, (
                f"heartbeat of {held.claim}: engine {got!r}, machine {want}\n" + "\n".join(self.steps[-15:]))

        # -- time and the coordinator --------------------------------------------------------

        @precondition(lambda self: self.held)
        @rule(data=st.data())
        def lease_lapses(self, data: st.DataObject) -> None:
            if data.draw(st.integers(0, 2)):   # a third of the time: most work finishes in its lease
                return
            held = _pick(data, self.held)
            c = held.claim
            b.sql("UPDATE task_instances SET lease_expires_at = now() - interval '1 millisecond' "
                  "WHERE run_id = %s AND id = %s AND attempt = %s AND state = 'RUNNING'",
                  (c.run_id, c.task_id, c.attempt))
            row = self.models[c.run_id].rows[c.node_id]
            if row.state is TaskState.RUNNING and row.attempt == c.attempt:
                _set(self.models[c.run_id], c.node_id, lease_expires_at=T0 - timedelta(milliseconds=1))
            self.steps.append(f"lease of {c.node_id} attempt {c.attempt} lapses")

        @precondition(lambda self: any(row.state is TaskState.WAITING and row.wake_at is not None
                                       and row.wake_at >= T0 for m in self.models.values() for row in m.rows.values()))
        @rule(data=st.data())
        def wake_up_comes(self, data: st.DataObject) -> None:
            run_id = _pick(data, [
                r for r, m in self.models.items()
                if any(row.state is TaskState.WAITING and row.wake_at is not None for row in m.rows.values())])
            # Each wake-up gets its own instant, in the model's node order: the timer loop
            # fires the oldest first, and two timeouts of one run firing in either order
            # may leave different nodes behind (a fail-timeout first cancels the other).
            model = self.models[run_id]
            waiting = [n for n, row in model.rows.items() if row.state is TaskState.WAITING and row.wake_at is not None]
            for i, node_id in enumerate(waiting):
                ago = timedelta(milliseconds=len(waiting) - i)
                b.sql("UPDATE task_instances SET wake_at = now() - %s WHERE run_id = %s AND node_id = %s "
                      "AND state = 'WAITING' AND wake_at IS NOT NULL", (ago, run_id, node_id))
                _set(model, node_id, wake_at=T0 - ago)
            self.steps.append(f"wake-ups of {run_id} come due")

        def lapsed(self) -> bool:
            return any(row.state is TaskState.RUNNING and row.lease_expires_at is not None and row.lease_expires_at < T0
                       for m in self.models.values() for row in m.rows.values())

        def due(self) -> bool:
            return any(row.state is TaskState.WAITING and row.wake_at is not None and row.wake_at < T0
                       for m in self.models.values() for row in m.rows.values())

        @precondition(lambda self: self.lapsed())
        @rule(fault=faults)
        def sweep(self, fault: tuple[Fault, int] | None) -> None:
            due = [(run_id, node_id, row.lease_owner) for run_id, m in self.models.items()
                   for node_id, row in m.rows.items()
                   if row.state is TaskState.RUNNING and row.lease_expires_at is not None and row.lease_expires_at < T0]
            self.faulted(fault, lambda: self.pass_until_quiet(["leases"]), "sweep")
            for run_id, node_id, owner in due:
                self.models[run_id].send(LeaseExpired(ref=self.models[run_id].ref(node_id, owner), now=T0))

        @precondition(lambda self: self.due())
        @rule(fault=faults)
        def timers(self, fault: tuple[Fault, int] | None) -> None:
            due = sorted((row.wake_at, run_id, node_id, row.task_id) for run_id, m in self.models.items()
                         for node_id, row in m.rows.items()
                         if row.state is TaskState.WAITING and row.wake_at is not None and row.wake_at < T0)
            self.faulted(fault, lambda: self.pass_until_quiet(["timers"]), "timers")
            for _, run_id, node_id, task_id in due:
                self.models[run_id].send(TimerDue(task_id=task_id, node_id=node_id, now=T0))

        def pass_until_quiet(self, loops: list[str]) -> None:
            """Passes until one changes nothing: a pass cut by a fault leaves its remaining
            candidates to the next one, as the coordinator's loop does."""
            for _ in range(5):
                stats = self.coordinator.run_once(loops)
                if not (stats.timers_fired or stats.leases_expired or stats.errors):
                    return

        # -- the comparison --------------------------------------------------------------------

        @invariant()
        def every_run_is_what_the_machine_says(self) -> None:
            if not self.models:
                return
            runs = {r[0]: r[1] for r in b.sql("SELECT id, status FROM workflow_runs WHERE id = ANY(%s)",
                                                 (list(self.models),))}
            tasks: dict[str, dict[str, tuple[str, int]]] = {}
            for run_id, node_id, state, attempt in b.sql(
                    "SELECT run_id, node_id, state, attempt FROM task_instances WHERE run_id = ANY(%s)",
                    (list(self.models),)):
                tasks.setdefault(run_id, {})[node_id] = (state, attempt)
            buffered = {r[0]: r[1] for r in b.sql(
                "SELECT run_id, count(*) FROM workflow_events WHERE consumed_at IS NULL AND run_id = ANY(%s) "
                "GROUP BY run_id", (list(self.models),))}
            for run_id, model in self.models.items():
                want_tasks = {n: (str(row.state), row.attempt) for n, row in model.rows.items()}
                want_buffered = sum(1 for s in model.signals if s.consumed_at is None)
                got = (runs.get(run_id), tasks.get(run_id, {}), buffered.get(run_id, 0))
                want = (str(model.status), want_tasks, want_buffered)
                assert got == want, (f"run {run_id} ({model.spec.id}): database {got}, machine {want}\n"
                                     + "\n".join(self.steps[-20:]))
            problems = invariant_problems(b.db_url)
            assert not problems, problems

    COUNTS.clear()
    try:
        run_state_machine_as_test(EngineAgainstMachine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]))
    finally:
        TALLY.parent.mkdir(parents=True, exist_ok=True)
        TALLY.write_text(json.dumps({"examples": EXAMPLES, "steps": STEPS, "faults": FAULTS,
                                     "counts": dict(sorted(COUNTS.items()))}, indent=1))


def _pick(data: st.DataObject, items: Sequence[T]) -> T:
    """One of ``items`` (never empty: the rule's precondition sees to it), drawn the same
    way whatever they are: hypothesis refuses a replayed example whose draws change shape
    (FlakyStrategyDefinition), and ``sampled_from(items)`` would draw from a range that
    depends on ``len(items)``; this draws from a fixed one. The lists themselves come from
    the model alone (see ``claim``), so a replay picks the same item."""
    return items[data.draw(st.integers(0, 63)) % len(items)]


def _set(model: Replay, node_id: str, **values: Any) -> None:
    """Move a model row's lease or wake-up instant, as the test moves the table's."""
    row = model.rows[node_id]
    for name, value in values.items():
        setattr(row, name, value)   # the machine reads the rows themselves: nothing else to refresh
