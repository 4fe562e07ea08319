"""The fault-injection harness: cut one write path at every request it sends.

A *write path* is three functions: ``setup()`` builds the state the operation needs
(through a direct engine, not the proxy), ``act(state)`` performs the operation once
through an engine whose only connection goes through the :class:`FaultProxy`, and
``check(state, result)`` says what is wrong afterwards (the path's own expectations).
:func:`sweep` first runs the path without a fault and records its requests, then
for each fault and each request number ``k`` runs it again on fresh state with the
fault armed at request ``k``: a connection dropped before the request, the request
completed and its acknowledgement lost (a COMMIT that committed), or the server
restarted at either point, or the request held back while the client's retry starts
(the first attempt still committing: its COMMIT reaches the server only once the
retry waits for its locks or commits itself). After each case the path's check and
the engine-wide invariants (:func:`invariant_problems`) must find nothing.

Restarts cost about a second each, so by default one is injected per path: after
the request that makes the operation durable (its last COMMIT), before the client
hears of it. A held request costs a retry's wait (0.2 s or more), so by default it is held
at that last COMMIT only. ``COMPOSER_FAULTS=full`` (``make chaos``) injects
restarts before and after every request and holds every request too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import psycopg

from composer_ops import Engine
from composer_ops.testing import servers
from composer_ops.testing.faultproxy import Fault, FaultProxy, Request

S = TypeVar("S")

FULL = os.environ.get("COMPOSER_FAULTS", "") == "full"
DROPS = (Fault.DROP_BEFORE, Fault.LOSE_ACK)
RESTARTS = (Fault.RESTART_BEFORE, Fault.RESTART_AFTER)
HOLDS = (Fault.HOLD_COMMIT,)
#: where each sweep's tally is appended (docs/reliability.md quotes it)
TALLY = Path(__file__).resolve().parents[2] / ".pytest_cache" / "composer-faults.jsonl"


@dataclass
class Result:
    """What ``act`` returned or raised."""

    value: Any = None
    error: BaseException | None = None

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class Case:
    fault: Fault | None
    k: int
    fired: Request | None
    result: Result
    problems: list[str]

    def __str__(self) -> str:
        where = f"{self.fault} at request {self.fired}" if self.fault else "no fault"
        err = f" (raised {type(self.result.error).__name__}: {self.result.error})" if self.result.error else ""
        return f"{where}{err}: " + "; ".join(self.problems)


@dataclass
class Bench:
    """The test database reached two ways: ``direct`` for set-up and checks,
    ``engine`` through the proxy (one pooled connection, so requests are numbered
    in the order the operation sends them)."""

    db_url: str
    proxy: FaultProxy
    direct: Engine
    engine: Engine

    def sql(self, query: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []


def can_restart() -> bool:
    return servers.session().primary.owned


@contextmanager
def bench(db_url: str) -> Iterator[Bench]:
    server = servers.session().primary
    restart = server.restart if server.owned else None
    with FaultProxy(db_url, restart=restart) as proxy, \
            Engine.connect(db_url, pool_size=2, application_name="faults-direct") as direct, \
            Engine.connect(proxy.url(), pool_size=1, application_name="faults-proxied") as engine:
        yield Bench(db_url=db_url, proxy=proxy, direct=direct, engine=engine)


@dataclass
class Sweep(Generic[S]):
    """The cases of one write path."""

    name: str
    cases: list[Case] = field(default_factory=list)
    recorded: list[Request] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Case]:
        return [c for c in self.cases if c.problems]

    def tally(self) -> dict[str, Any]:
        by_fault: dict[str, int] = {}
        for c in self.cases:
            key = str(c.fault) if c.fault else "none"
            by_fault[key] = by_fault.get(key, 0) + 1
        return {"path": self.name, "requests": len(self.recorded),
                "commits": sum(r.commits for r in self.recorded), "cases": by_fault,
                "skipped": self.skipped, "failed": len(self.failures)}

    def assert_clean(self) -> None:
        TALLY.parent.mkdir(parents=True, exist_ok=True)
        with TALLY.open("a", encoding="utf-8") as out:
            out.write(json.dumps({**self.tally(), "server": servers.session().primary.version}) + "\n")
        if self.failures:
            lines = [f"{self.name}: {len(self.failures)} of {len(self.cases)} fault cases broke an invariant"]
            lines += [f"  {c}" for c in self.failures[:25]]
            lines += ["requests of the path (no fault):"] + [f"  {r}" for r in self.recorded]
            raise AssertionError("\n".join(lines))


def sweep(b: Bench, name: str, *, setup: Callable[[], S], act: Callable[[S], Any],
          check: Callable[[S, Result], list[str]], faults: Sequence[Fault] = DROPS + RESTARTS + HOLDS,
          settle: Callable[[S], None] | None = None, every_request: bool = True) -> Sweep[S]:
    """Run the path without a fault, then with each fault at every request number.

    ``every_request`` false: a path whose every case costs seconds (an archive written
    and read back) is cut at its COMMITs only, unless ``COMPOSER_FAULTS=full``.
    ``settle(state)`` runs after ``act`` and before the checks, without faults (for
    paths whose effect completes later, such as a webhook retried after its lease)."""
    out: Sweep[S] = Sweep(name)
    for _ in range(2):     # the first run warms the caches (definitions, prepared statements)
        state = setup()
        b.proxy.reset()
        result = _run(act, state)
        out.recorded = list(b.proxy.requests)
        out.cases.append(_judge(b, None, 0, None, state, result, check, settle))
    n = len(out.recorded)
    if n == 0:
        raised = f"; it raised {type(result.error).__name__}: {result.error}" if result.error else ""
        raise AssertionError(f"{name}: the operation sent no request through the proxy{raised} "
                             f"(proxy: {b.proxy.describe()})")
    commits = [r.index for r in out.recorded if r.commits]
    # the commit that makes the operation's effect durable (its last)
    last_commit = commits[-1:]
    for fault in faults:
        if fault.restarts and not can_restart():
            continue
        if fault is Fault.RESTART_BEFORE and not FULL:
            continue           # a drop before the request covers the rollback; restarts cost a second
        if FULL or (every_request and not (fault.restarts or fault is Fault.HOLD_COMMIT)):
            ks: Sequence[int] = range(1, n + 1)
        else:
            ks = last_commit if fault.restarts or fault is Fault.HOLD_COMMIT else commits
        for k in ks:
            state = setup()
            b.proxy.reset()
            b.proxy.arm(fault, at=k)
            result = _run(act, state)
            fired = b.proxy.wait_fired(60) if fault.restarts else b.proxy.fired
            b.proxy.disarm()
            b.proxy.release()           # a held request the operation's retry never waited for
            if not b.proxy.wait_released(60):
                raise AssertionError(f"{name}: the request held at {fault}@{k} was never answered")
            if fired is None:      # this time the path sent fewer requests (nothing was due, say)
                out.skipped.append(f"{fault}@{k}/{b.proxy.count}")
                continue
            out.cases.append(_judge(b, fault, k, fired, state, result, check, settle))
    return out


def _run(act: Callable[[S], Any], state: S) -> Result:
    try:
        return Result(value=act(state))
    except Exception as exc:  # judged by the path's check
        return Result(error=exc)


def _judge(b: Bench, fault: Fault | None, k: int, fired: Request | None, state: S, result: Result,
           check: Callable[[S, Result], list[str]], settle: Callable[[S], None] | None) -> Case:
    problems: list[str] = []
    try:
        if settle is not None:
            settle(state)
        problems += check(state, result)
    except Exception as exc:  # a check that cannot even read the state is a finding too
        problems.append(f"the check raised {type(exc).__name__}: {exc}")
    problems += invariant_problems(b.db_url)
    return Case(fault, k, fired, result, problems)


# -- invariants that hold for every database state between events ------------------

INVARIANTS: dict[str, str] = {
    "a PENDING task has no dispatch (it will never run)": """
        SELECT t.run_id, t.node_id, t.attempt FROM task_instances t
          JOIN workflow_runs r ON r.id = t.run_id
         WHERE t.node_type = 'TASK' AND t.state IN ('PENDING', 'QUEUED') AND r.status IN ('PENDING', 'RUNNING')
           AND NOT EXISTS (SELECT 1 FROM task_outbox o
                            WHERE o.run_id = t.run_id AND o.task_id = t.id AND o.attempt = t.attempt)""",
    "an outbox row whose task attempt is not waiting for dispatch": """
        SELECT o.run_id, o.task_id, o.attempt, t.state, t.attempt FROM task_outbox o
          LEFT JOIN task_instances t ON t.run_id = o.run_id AND t.id = o.task_id
         WHERE t.id IS NULL OR t.state NOT IN ('PENDING', 'QUEUED') OR t.attempt <> o.attempt""",
    "a finished run has an active task": """
        SELECT r.id, r.status, t.node_id, t.state FROM workflow_runs r
          JOIN task_instances t ON t.run_id = r.id
         WHERE r.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
           AND t.state IN ('PENDING', 'QUEUED', 'RUNNING', 'WAITING')""",
    "a RUNNING task without a lease": """
        SELECT run_id, node_id, attempt FROM task_instances
         WHERE state = 'RUNNING' AND (lease_owner IS NULL OR lease_expires_at IS NULL)""",
    "a buffered signal left unconsumed while a node waits for it": """
        SELECT e.run_id, e.name, t.node_id FROM workflow_events e
          JOIN task_instances t ON t.run_id = e.run_id AND t.state = 'WAITING' AND t.signal_name = e.name
         WHERE e.consumed_at IS NULL""",
    "a webhook delivery for a run that has not finished": """
        SELECT d.run_id, r.status FROM webhook_deliveries d
          LEFT JOIN workflow_runs r ON r.id = d.run_id
         WHERE r.id IS NULL OR r.status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED')""",
    # (the coordinator prunes deliveries days after they finished, so only runs finished
    # within the last day must still have theirs)
    "a run finished within a day, of a definition with a webhook, has no delivery": """
        SELECT r.id FROM workflow_runs r
          JOIN workflow_definitions d ON d.id = r.workflow_definition_id AND d.version = r.workflow_version
         WHERE d.webhook_url IS NOT NULL AND r.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
           AND r.completed_at > now() - interval '1 day'
           AND NOT EXISTS (SELECT 1 FROM webhook_deliveries w WHERE w.run_id = r.id)""",
    "a SUCCEEDED run with a task that did not finish well": """
        SELECT r.id, t.node_id, t.state FROM workflow_runs r JOIN task_instances t ON t.run_id = r.id
         WHERE r.status = 'SUCCEEDED' AND t.state NOT IN ('COMPLETED', 'SKIPPED', 'FAILED')""",
}


def invariant_problems(db_url: str) -> list[str]:
    out: list[str] = []
    with psycopg.connect(db_url, autocommit=True) as conn:
        for what, query in INVARIANTS.items():
            rows = conn.execute(query).fetchall()
            if rows:
                out.append(f"{what}: {rows[:3]}{' ...' if len(rows) > 3 else ''}")
    return out


def expire_leases(b: Bench, run_id: str) -> None:
    """Time passes for one run: every lease it holds is already over (the database
    clock is not ours to move, so the expiry instant is moved instead)."""
    b.sql("UPDATE task_instances SET lease_expires_at = now() - interval '1 millisecond' "
          "WHERE run_id = %s AND state = 'RUNNING'", (run_id,))


def make_due(b: Bench, run_id: str) -> None:
    """Time passes for one run's timers: every wake-up is already due."""
    b.sql("UPDATE task_instances SET wake_at = now() - interval '1 millisecond' "
          "WHERE run_id = %s AND state = 'WAITING' AND wake_at IS NOT NULL", (run_id,))
