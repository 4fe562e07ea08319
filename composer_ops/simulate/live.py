"""Live traffic through real coordinator and worker processes.

The driver spawns ``composer-ops coordinator`` and simulator worker processes, then plays
a plan drawn from the seed: Poisson-timed starts, signals early (buffered), late, too
late (refused) or never, duplicates, cancellations, and ``kill_workers`` SIGKILLs of the
busiest worker (the last one as the simulation stops, leaving lapsing leases for the
lease report). After ``duration_s`` everything stops with runs in flight, once at least
one run has finished (a loaded machine's workers may not have served anything yet). The
plan is a function of the seed; what the processes make of it depends on real timing.
"""

from __future__ import annotations

import heapq
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_ops.db.retry import db_retry
from composer_ops.engine.ids import uuid7_at
from composer_ops.errors import ComposerError, Conflict
from composer_ops.processes import Fleet, Kind, Proc
from composer_ops.repo import simulator
from composer_ops.simulate.definitions import (
    LEASE_S,
    WORKFLOW_WEIGHTS,
    SignalPlan,
    make_input,
    plan_cancel,
    plan_signals,
)
from composer_ops.simulate.model import Behaviour

if TYPE_CHECKING:
    from composer_ops.engine import Engine

__all__ = ["HeldTask", "LiveOptions", "LiveResult", "LiveSimulation", "PlannedRun", "StartFailure", "plan_live",
           "simulation_fleet"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_APP = "composer_ops.simulate.handlers:make_worker"
_COORDINATOR_INTERVAL_S = 0.25
_POLL_S = 0.25
_MAX_UNEXPECTED_EXITS = 4
#: A kill waits up to this long for a worker holding at least _KILL_MIN_BUSY running
#: tasks, then takes any worker holding one.
_KILL_PATIENCE_S = 5.0
_KILL_MIN_BUSY = 3
#: Calls of Engine.start per planned run when it raises Transient (each call already
#: retries its own transaction): a server restarting or a pool exhausted for a while.
_START_ATTEMPTS = 4
#: After the traffic, the fleet runs on until a started run has finished, at most this
#: long: on a loaded machine a short simulation can end before the workers (whole Python
#: processes to start) have served anything, and what it left would show no progress.
PROGRESS_DEADLINE_S = 180.0


@dataclass(frozen=True, kw_only=True)
class LiveOptions:
    seed: int
    runs: int
    duration_s: float
    behaviour: Behaviour = field(default_factory=Behaviour)
    workers: int = 3
    concurrency: int = 8
    coordinators: int = 1
    kill_workers: int = 1
    cancel_rate: float = 0.03


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """One run of the plan: when it starts (seconds into the simulation) and what it meets."""

    index: int
    at_s: float
    workflow_id: str
    signals: tuple[SignalPlan, ...]
    cancel: tuple[float, str] | None


def plan_live(options: LiveOptions) -> list[PlannedRun]:
    """The seed's plan: ``runs`` arrivals spread over ``duration_s`` (a Poisson
    process given its count), each with its workflow, signals and cancellation."""
    rng = random.Random(f"composer-sim-live:{options.seed}")
    names, weights = list(WORKFLOW_WEIGHTS), list(WORKFLOW_WEIGHTS.values())
    arrivals = sorted(rng.uniform(0.0, options.duration_s) for _ in range(options.runs))
    scale = options.behaviour.time_scale
    plans: list[PlannedRun] = []
    for index, at in enumerate(arrivals):
        wf = rng.choices(names, weights)[0]
        plans.append(PlannedRun(index=index, at_s=at, workflow_id=wf,
                                signals=tuple(plan_signals(rng, wf, scale)),
                                cancel=plan_cancel(rng, options.cancel_rate, scale)))
    return plans


@dataclass(frozen=True, kw_only=True)
class HeldTask:
    """A task a worker was running when it was killed."""

    run_id: str
    task_id: str
    attempt: int


@dataclass(frozen=True, kw_only=True)
class StartFailure:
    """A planned start the database refused, after the retries of a transient error."""

    index: int
    workflow_id: str
    error: str


@dataclass
class LiveResult:
    """What the driver did and saw; the database tells the rest (see ``summary``)."""

    run_ids: list[str] = field(default_factory=list)
    start_failures: list[StartFailure] = field(default_factory=list)
    start_retries: int = 0                      # Engine.start calls repeated after a transient error
    signals: Counter[str] = field(default_factory=Counter)
    cancels: Counter[str] = field(default_factory=Counter)
    kills: list[tuple[str, list[HeldTask]]] = field(default_factory=list)   # (lease owner, its RUNNING tasks)
    unexpected_exits: list[str] = field(default_factory=list)
    seconds: float = 0.0
    progress_wait_s: float = 0.0                # after the traffic, waiting for a first finished run
    log_dir: str | None = None


def simulation_fleet(url: str, behaviour: Behaviour, logdir: Path | None = None) -> Fleet:
    """The simulation's processes: the behaviour model in their environment, and this
    package importable even from a source tree that is not installed; their logs in
    ``logdir`` (else a temporary directory of the fleet's own)."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, **behaviour.to_env(), "COMPOSER_LOG_LEVEL": "WARNING",
           "PYTHONPATH": str(_PACKAGE_ROOT) + (os.pathsep + path if path else "")}
    return Fleet(url, app=_APP, coordinator_interval=_COORDINATOR_INTERVAL_S, env=env, logdir=logdir)


def _owner(proc: Proc) -> str:
    """The lease owner a simulated worker writes."""
    return f"{proc.name}:{proc.pid}"


def _tail(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


@dataclass
class _RunState:
    plan: PlannedRun
    run_id: str
    finished: bool = False
    awaiting: list[SignalPlan] = field(default_factory=list)    # late / too-late plans waiting for the node


class LiveSimulation:
    """Drives one live simulation; ``run()`` blocks until it has stopped."""

    def __init__(self, engine: Engine, options: LiveOptions,
                 on_progress: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.engine, self.options, self.on_progress = engine, options, on_progress
        self.result = LiveResult()
        self.runs: dict[int, _RunState] = {}
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._clock_offset = 0.0
        self._spawned: Counter[str] = Counter()

    # -- scheduling ---------------------------------------------------------------

    def _at(self, when: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, kind, payload))

    def _kill_times(self) -> tuple[list[tuple[float, float]], bool]:
        """(when, deadline) of the kills during the run, and whether one ends it. A
        kill waits until ``deadline`` for a worker holding a few running tasks; its
        leases must still lapse and be swept before the end."""
        n, duration = self.options.kill_workers, self.options.duration_s
        during = n - 1 if n >= 2 else n
        patience = min(_KILL_PATIENCE_S, 0.15 * duration)
        last = max(0.1 * duration, duration - LEASE_S - 2.0 - patience)
        first = min(0.1 * duration, last)
        times = [first + (last - first) * (k + 1) / (during + 1) for k in range(during)]
        return [(t, t + patience) for t in times], n >= 2

    # -- the run --------------------------------------------------------------------

    def run(self) -> LiveResult:
        options = self.options
        with self.engine.pool.connection() as conn:
            db_now = simulator.clock(conn)
        self._clock_offset = db_now.timestamp() - time.time()
        fleet = simulation_fleet(self.engine.url, options.behaviour)
        failed = True
        try:
            for _ in range(options.coordinators):
                self._spawn(fleet, "coordinator")
            for _ in range(options.workers):
                self._spawn(fleet, "worker")
            for planned in plan_live(options):
                self._at(planned.at_s, "start", planned)
            kill_times, kill_at_end = self._kill_times()
            for when, deadline in kill_times:
                self._at(when, "kill", deadline)
            self._loop(fleet, options.duration_s)
            self._await_progress(fleet, PROGRESS_DEADLINE_S)
            if kill_at_end:
                self._kill(fleet, replace=False, min_busy=1)
            fleet.terminate("coordinator", timeout=10)
            fleet.terminate("worker", timeout=20)
            failed = bool(self.result.unexpected_exits)
        finally:
            fleet.stop(timeout=5, keep_logs=failed)
            self.result.log_dir = str(fleet.logdir) if failed else None
        return self.result

    def _spawn(self, fleet: Fleet, kind: Kind) -> Proc:
        """A worker or coordinator named ``sim-wN`` / ``sim-cN``; a worker's lease owner is
        ``<name>:<pid>`` (``make_worker`` reads the name from ``COMPOSER_SIM_WORKER_NAME``)."""
        self._spawned[kind] += 1
        name = f"sim-{'w' if kind == 'worker' else 'c'}{self._spawned[kind]}"
        if kind == "worker":
            return fleet.worker(concurrency=self.options.concurrency, env={"COMPOSER_SIM_WORKER_NAME": name},
                                name=name)
        return fleet.coordinator(env={"COMPOSER_SIM_WORKER_NAME": name}, name=name)

    def _loop(self, fleet: Fleet, stop_at: float) -> None:
        t0 = time.monotonic()
        last_poll = last_check = -1.0
        while True:
            now = time.monotonic() - t0
            if now >= stop_at:
                # Starts fall behind their instants when the machine is loaded (each one
                # is a transaction); the plan's last ones are still due: make them.
                self._start_overdue(now)
                break
            while self._events and self._events[0][0] <= now:
                _, _, kind, payload = heapq.heappop(self._events)
                self._handle(fleet, kind, payload, now)
            if now - last_poll >= _POLL_S:
                self._poll(now)
                last_poll = now
                self._report("live")
            if now - last_check >= 1.0:
                self._check(fleet)
                last_check = now
            pause = (self._events[0][0] - now) if self._events else _POLL_S
            time.sleep(min(max(pause, 0.005), 0.05))
        self.result.seconds = time.monotonic() - t0
        self._poll(stop_at)
        self._report("stopped")

    def _await_progress(self, fleet: Fleet, deadline_s: float) -> None:
        """Keep the fleet running after the traffic until a started run has finished, or
        ``deadline_s`` has passed (then the caller reports that nothing made progress)."""
        t0 = time.monotonic()
        while self.runs and not any(s.finished for s in self.runs.values()):
            waited = time.monotonic() - t0
            if waited >= deadline_s:
                break
            self._check(fleet)
            time.sleep(_POLL_S)
            self._poll(self.result.seconds + waited)
            self._report("waiting")
        self.result.progress_wait_s = time.monotonic() - t0

    def _handle(self, fleet: Fleet, kind: str, payload: Any, now: float) -> None:
        if kind == "start":
            self._start(payload, now)
        elif kind == "signal":
            index, plan, duplicate = payload
            self._signal(self.runs[index], plan, duplicate, now)
        elif kind == "cancel":
            self._cancel(self.runs[payload], now)
        elif kind == "kill":
            # Kill a worker mid-task: until the deadline, one that holds a few tasks.
            if not self._kill(fleet, replace=True, min_busy=_KILL_MIN_BUSY if now < payload else 1):
                self._at(now + _POLL_S, "kill", payload)

    def _start_overdue(self, now: float) -> None:
        """Make the planned starts still queued; the other events due after the end
        (signals, cancellations, kills) are dropped with the runs left active."""
        overdue = sorted((e for e in self._events if e[2] == "start"), key=lambda e: (e[0], e[1]))
        self._events = [e for e in self._events if e[2] != "start"]
        heapq.heapify(self._events)
        for _, _, _, planned in overdue:
            self._start(planned, now)

    def _start(self, planned: PlannedRun, now: float) -> None:
        rng = random.Random(f"composer-sim-live:{self.options.seed}:run:{planned.index}")
        sim = {"seed": self.options.seed, "run": f"live-{planned.index}"}
        db_now = time.time() + self._clock_offset
        run_input = make_input(rng, planned.workflow_id, sim, db_now, self.options.behaviour.time_scale)
        # The run ID is chosen here, so a retry whose earlier call committed finds its run
        # instead of starting a second one; minted now, it is fresh by the database clock.
        run_id = uuid7_at(datetime.fromtimestamp(db_now, UTC))
        calls: list[int] = []
        try:
            self._start_run(planned.workflow_id, run_input, run_id, calls)
        except ComposerError as exc:
            self.result.start_failures.append(StartFailure(index=planned.index, workflow_id=planned.workflow_id,
                                                           error=f"{type(exc).__name__}: {exc}"))
            return
        finally:
            self.result.start_retries += max(0, len(calls) - 1)
        self.result.run_ids.append(run_id)
        state = self.runs[planned.index] = _RunState(plan=planned, run_id=run_id)
        for plan in planned.signals:
            if plan.timing == "early":
                self._at(now + plan.delay_s, "signal", (planned.index, plan, False))
            elif plan.timing in ("late", "too_late"):
                state.awaiting.append(plan)
            else:
                self.result.signals["never sent"] += 1
        if planned.cancel is not None:
            self._at(now + planned.cancel[0], "cancel", planned.index)

    @db_retry(_START_ATTEMPTS, base=0.25)
    def _start_run(self, workflow_id: str, run_input: Any, run_id: str, calls: list[int]) -> None:
        calls.append(1)
        try:
            self.engine.start(workflow_id, input=run_input, run_id=run_id)
        except Conflict:
            # A call whose acknowledgement was lost committed the run: it is started.
            if len(calls) > 1:
                with self.engine.pool.connection() as conn:
                    if simulator.existing_runs(conn, [run_id]):
                        return
            raise

    def _signal(self, state: _RunState, plan: SignalPlan, duplicate: bool, now: float) -> None:
        label = "duplicate" if duplicate else plan.timing.replace("_", " ")
        try:
            self.engine.signal(state.run_id, plan.name, plan.payload)
        except Conflict:
            self.result.signals[f"{label}: refused (run finished)"] += 1
            return
        except ComposerError:
            self.result.signals[f"{label}: error"] += 1
            return
        self.result.signals[f"{label}: accepted"] += 1
        if plan.duplicate_after_s is not None and not duplicate:
            self._at(now + plan.duplicate_after_s, "signal", (state.plan.index, plan, True))

    def _cancel(self, state: _RunState, now: float) -> None:
        assert state.plan.cancel is not None
        try:
            outcome = self.engine.cancel(state.run_id, reason=state.plan.cancel[1])
        except Conflict:
            self.result.cancels["too late (run finished)"] += 1
            return
        self.result.cancels["applied" if outcome.applied else "stale"] += 1

    def _kill(self, fleet: Fleet, *, replace: bool, min_busy: int) -> bool:
        """SIGKILL the busiest worker (running tasks of the most runs, then the most
        tasks) if it holds at least ``min_busy`` running tasks; returns whether one was
        killed. The tasks it held are recorded, to tell later whether they were retried."""
        workers = fleet.alive("worker")
        if not workers:
            return True
        owners = {_owner(w): w for w in workers}
        with self.engine.pool.connection() as conn:
            rows = simulator.running_tasks(conn, list(owners))
        held: dict[str, list[HeldTask]] = {}
        for owner, run_id, task_id, attempt in rows:
            held.setdefault(owner, []).append(HeldTask(run_id=run_id, task_id=task_id, attempt=attempt))

        def busy(w: Proc) -> tuple[int, int, int]:
            tasks = held.get(_owner(w), [])
            return len({t.run_id for t in tasks}), len(tasks), -workers.index(w)

        victim = max(workers, key=busy)
        tasks = held.get(_owner(victim), [])
        if len(tasks) < min_busy:
            return False
        fleet.kill(victim)
        self.result.kills.append((_owner(victim), tasks))
        if replace:
            self._spawn(fleet, "worker")
        return True

    # -- observing --------------------------------------------------------------------

    def _poll(self, now: float) -> None:
        """Finished runs, and WAIT_FOR_SIGNAL nodes that started waiting (for late signals)."""
        open_runs = [s for s in self.runs.values() if not s.finished]
        if not open_runs:
            return
        by_id = {s.run_id: s for s in open_runs}
        awaiting = [s.run_id for s in open_runs if s.awaiting]
        with self.engine.pool.connection() as conn:
            done = simulator.finished_runs(conn, list(by_id))
            waiting = simulator.waiting_signals(conn, awaiting) if awaiting else []
        for run_id in done:
            by_id[run_id].finished = True
        for run_id, name in waiting:
            state = by_id[run_id]
            for plan in [p for p in state.awaiting if p.name == name]:
                state.awaiting.remove(plan)
                self._at(now + plan.delay_s, "signal", (state.plan.index, plan, False))

    def _check(self, fleet: Fleet) -> None:
        for proc in fleet.exited():
            reason = _tail(proc.log) or f"exit code {proc.popen.returncode}"
            self.result.unexpected_exits.append(f"{proc.name} ({proc.kind}) exited: {reason}")
            if len(self.result.unexpected_exits) >= _MAX_UNEXPECTED_EXITS:
                raise ComposerError(f"simulation stopped: {len(self.result.unexpected_exits)} processes exited "
                                    f"unexpectedly; last: {self.result.unexpected_exits[-1]} "
                                    f"(logs under {fleet.logdir})")
            self._spawn(fleet, proc.kind)

    def _report(self, phase: str) -> None:
        if self.on_progress is None:
            return
        finished = sum(1 for s in self.runs.values() if s.finished)
        self.on_progress(phase, {"started": len(self.result.run_ids), "finished": finished,
                                 "active": len(self.runs) - finished, "killed": len(self.result.kills)})
