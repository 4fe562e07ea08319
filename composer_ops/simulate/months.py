"""Generated months: past runs written with COPY.

For each of the N complete UTC months before the current one, ``backfill`` replays
``runs`` runs through the state machine (:mod:`composer_ops.simulate.past`), so every
row is the machine's decision, with UUIDv7 IDs stamped in their month. Everything is
drawn from ``random.Random`` seeded by (seed, month), chunk by chunk, so the same options
give byte-identical rows whatever the number of worker processes; a month whose first
run exists is skipped. A few runs wait for ever, still RUNNING in the ``stuck_months``
latest months. Each month is one COPY transaction with every constraint in place; with
``set_based_checks`` and a role that may set ``session_replication_role``, foreign keys
are checked per chunk in bulk (an orphan rolls the month back).
"""

from __future__ import annotations

import calendar
import itertools
import math
import multiprocessing
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import date, datetime

from composer_ops.core.runids import add_months, month_label, month_start
from composer_ops.core.spec import WorkflowSpec
from composer_ops.db.connect import autocommit, connect
from composer_ops.errors import Invalid
from composer_ops.repo import simulator as repo
from composer_ops.repo._base import Conn
from composer_ops.repo.partitions import ensure_from
from composer_ops.simulate.copytext import RUN_COLUMNS, SIGNAL_COLUMNS, TASK_COLUMNS, CopyText, json_text
from composer_ops.simulate.definitions import WORKFLOW_WEIGHTS, make_input, plan_cancel, plan_signals
from composer_ops.simulate.model import Behaviour
from composer_ops.simulate.past import Plan, play, stop_stuck
from composer_ops.simulate.replay import Replay, utc

__all__ = ["MonthsOptions", "MonthsResult", "MonthResult", "backfill", "generated_months", "marker_run_id",
           "month_sizes"]

#: Relative arrival rate per hour of day (UTC): office hours for people, nights for batches.
_DAY_HOURS = (0.25, 0.2, 0.15, 0.15, 0.2, 0.3, 0.5, 0.9, 1.3, 1.6, 1.7, 1.6, 1.4, 1.5, 1.6, 1.6, 1.5, 1.3,
              1.1, 1.0, 0.9, 0.7, 0.5, 0.35)
_NIGHT_HOURS = (0.3, 1.0, 1.0, 0.6) + (0.0,) * 20
_STUCK_REASON = "stuck for weeks: the carrier never scanned the parcel; cancelled by on-call"


@dataclass(frozen=True, kw_only=True)
class MonthsOptions:
    """What to backfill. ``runs_per_month`` is the mean over the months; with
    ``growth`` g each month has (1+g) times the runs of the month before."""

    seed: int
    months: int
    runs_per_month: int
    behaviour: Behaviour = field(default_factory=Behaviour)
    growth: float = 0.08
    stuck_months: int = 3
    cancel_rate: float = 0.03
    chunk_runs: int = 1000
    #: Worker processes playing runs (0: one per CPU).
    processes: int = 0
    #: Check the task and signal rows' foreign keys with one query per month instead
    #: of one trigger call per row, when the session is allowed to (see ``backfill``).
    set_based_checks: bool = True

    def __post_init__(self) -> None:
        # stuck_months >= 1: an operator's clean-up of older months happens within
        # the month after theirs, so it is always in the past.
        for name, low in (("months", 0), ("runs_per_month", 1), ("stuck_months", 1), ("chunk_runs", 1),
                          ("processes", 0)):
            if getattr(self, name) < low:
                raise Invalid(f"history {name.replace('_', '-')} must be at least {low}, got {getattr(self, name)}")


@dataclass
class MonthResult:
    month: str
    runs: int = 0
    tasks: int = 0
    signals: int = 0
    active_runs: int = 0
    skipped: bool = False


@dataclass
class MonthsResult:
    months: list[MonthResult]
    seconds: float
    #: True when the foreign keys of task and signal rows were checked per month
    #: (one anti-join) rather than per row by their triggers.
    set_based_checks: bool = False

    @property
    def runs(self) -> int:
        return sum(m.runs for m in self.months)

    @property
    def tasks(self) -> int:
        return sum(m.tasks for m in self.months)

    @property
    def rows(self) -> int:
        return sum(m.runs + m.tasks + m.signals for m in self.months)

    @property
    def task_rows_per_s(self) -> float:
        return self.tasks / self.seconds if self.seconds > 0 else 0.0


def generated_months(now: datetime, count: int) -> list[str]:
    """The ``count`` complete UTC months before ``now``'s month, oldest first (YYYYMM)."""
    current = month_label(now)
    return [add_months(current, -k) for k in range(count, 0, -1)]


def month_sizes(months: list[str], runs_per_month: int, growth: float) -> dict[str, int]:
    """Runs per month: each month ``1 + growth`` times the one before, ``runs_per_month``
    times the number of months in all (largest remainders get the rounding)."""
    if not months:
        return {}
    weights = [(1.0 + growth) ** i for i in range(len(months))]
    shares = [runs_per_month * len(months) * w / sum(weights) for w in weights]
    sizes = [math.floor(x) for x in shares]
    for i in sorted(range(len(months)), key=lambda i: sizes[i] - shares[i])[:runs_per_month * len(months)
                                                                              - sum(sizes)]:
        sizes[i] += 1
    return {m: max(1, n) for m, n in zip(months, sizes, strict=True)}


def _month_bounds(month: str) -> tuple[float, float, int]:
    start, end = month_start(month), month_start(add_months(month, 1))
    return start.timestamp(), end.timestamp(), (end - start).days


def _uuid7(ms: int, rng: random.Random) -> str:
    value = (ms << 80) | (0x7 << 76) | (rng.getrandbits(12) << 64) | (0x2 << 62) | rng.getrandbits(62)
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _marker_rng(seed: int, month: str) -> random.Random:
    return random.Random(f"composer-sim-history:{seed}:{month}:first")


def _marker_start(rng: random.Random, month: str) -> float:
    return _month_bounds(month)[0] + rng.uniform(0.5, 30.0)


def marker_run_id(seed: int, month: str) -> str:
    """The ID of the month's first backfilled run for ``seed``: its presence means
    the month was already backfilled with that seed."""
    rng = _marker_rng(seed, month)
    t0 = _marker_start(rng, month)
    return _uuid7(int(t0 * 1000), rng)


@dataclass
class _Chunk:
    """Consecutive runs of one month as COPY text; ``last`` ends its month."""

    month: str
    last: bool
    runs: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)
    active: int = 0


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What one worker process generates: the runs of a month from its ``first``th
    (0 is the month's marker run), started at ``arrivals``."""

    month: str
    age: int
    first: int
    arrivals: tuple[tuple[float, str], ...]
    last: bool


def _arrivals(seed: int, month: str, runs: int) -> list[tuple[float, str]]:
    """Start instants and workflows of the month's runs after the first, in time order."""
    rng = random.Random(f"composer-sim-history:{seed}:{month}")
    start, _, days = _month_bounds(month)
    names = list(WORKFLOW_WEIGHTS)
    cum_wf = list(_cumulative(WORKFLOW_WEIGHTS.values()))
    year, mon = int(month[:4]), int(month[4:])
    cum_days = list(_cumulative(0.55 if calendar.weekday(year, mon, d + 1) >= 5 else 1.0 for d in range(days)))
    cum_day_hours, cum_night_hours = list(_cumulative(_DAY_HOURS)), list(_cumulative(_NIGHT_HOURS))
    out: list[tuple[float, str]] = []
    for _ in range(runs - 1):
        wf = rng.choices(names, cum_weights=cum_wf)[0]
        day = rng.choices(range(days), cum_weights=cum_days)[0]
        hour = rng.choices(range(24), cum_weights=cum_night_hours if wf == "nightly-batch" else cum_day_hours)[0]
        out.append((start + day * 86_400 + hour * 3_600 + rng.random() * 3_600, wf))
    out.sort()
    return out


def _jobs(seed: int, month: str, age: int, runs: int, chunk_runs: int) -> Iterator[_Job]:
    arrivals = _arrivals(seed, month, runs)
    for first in range(0, runs, chunk_runs):
        # arrivals[i - 1] is run i's: run 0, the marker, starts at its own instant.
        yield _Job(month=month, age=age, first=first, last=first + chunk_runs >= runs,
                   arrivals=tuple(arrivals[max(first - 1, 0):first + chunk_runs - 1]))


def _cumulative(weights: Iterable[float]) -> Iterator[float]:
    total = 0.0
    for w in weights:
        total += w
        yield total


class _Generator:
    """Plays runs through the machine and formats their rows; one per worker process."""

    def __init__(self, specs: Mapping[str, WorkflowSpec], versions: Mapping[str, int],
                 options: MonthsOptions) -> None:
        self.specs, self.versions, self.options = specs, versions, options
        self.behaviour, self.scale = options.behaviour, options.behaviour.time_scale
        self.flawless = replace(self.behaviour, transient_rate=0.0, permanent_rate=0.0, crash_rate=0.0)
        self.text = CopyText()
        self.configs = {wf: json_text(dict(spec.config)) for wf, spec in specs.items()}

    def chunk(self, job: _Job) -> _Chunk:
        seed, month = self.options.seed, job.month
        chunk = _Chunk(month=month, last=job.last)
        end = _month_bounds(month)[1]
        if job.first == 0:
            # The month's first run, an order the carrier never scans, is the idempotency marker.
            marker = _marker_rng(seed, month)
            self.run(chunk, marker, "order-fulfilment", _marker_start(marker, month), f"h{month}-0", job.age, end,
                     stuck=True)
        rng = random.Random(f"composer-sim-history:{seed}:{month}:{job.first}")
        first = max(job.first, 1)
        for i, (t0, wf) in enumerate(job.arrivals, start=first):
            self.run(chunk, rng, wf, t0, f"h{month}-{i}", job.age, end, stuck=False)
        return chunk

    def run(self, chunk: _Chunk, rng: random.Random, wf: str, t0: float, key: str, age: int, month_end: float,
            *, stuck: bool) -> None:
        """Replay one run started at ``t0`` and add its rows to ``chunk``."""
        spec, scale = self.specs[wf], self.scale
        run_id = _uuid7(int(t0 * 1000), rng)
        run_input = make_input(rng, wf, {"seed": self.options.seed, "run": key}, t0, scale)
        signals = plan_signals(rng, wf, scale)
        cancel = plan_cancel(rng, self.options.cancel_rate, scale)
        behaviour = self.behaviour
        if stuck:
            # Nothing fails and nobody cancels: the run reaches its wait and stays there.
            signals = [replace(p, timing="never", duplicate_after_s=None) for p in signals]
            cancel, behaviour = None, self.flawless
        plan = Plan(signals=tuple(signals), cancel=cancel)

        def mint(kind: str, at: datetime) -> str:
            return _uuid7(int(at.timestamp() * 1000), rng)

        replay = Replay(spec, run_id=run_id, input=run_input, now=utc(t0), workflow_version=self.versions[wf],
                        mint=mint)
        play(replay, rng, behaviour, plan, t0)
        if age > self.options.stuck_months:
            stop_stuck(replay, month_end + rng.uniform(0.5, 9.5) * 86_400, _STUCK_REASON)
        text = self.text
        text.next_run()
        chunk.runs.append(text.run(replay, wf, self.configs[wf]))
        chunk.tasks.extend(text.task(run_id, row) for row in replay.rows.values())
        chunk.signals.extend(text.signal(run_id, signal) for signal in replay.signals)
        chunk.active += replay.status == "RUNNING"


_worker: _Generator | None = None


def _start_worker(specs: Mapping[str, WorkflowSpec], versions: Mapping[str, int], options: MonthsOptions) -> None:
    global _worker
    _worker = _Generator(specs, versions, options)


def _generate(job: _Job) -> _Chunk:
    assert _worker is not None, "the worker process was not started by _start_worker"
    return _worker.chunk(job)


# -- writing ------------------------------------------------------------------------------


def _copy(conn: Conn, chunk: _Chunk, result: MonthResult, *, skip_row_triggers: bool) -> None:
    for table, columns, lines in (("workflow_runs", RUN_COLUMNS, chunk.runs),
                                  ("task_instances", TASK_COLUMNS, chunk.tasks),
                                  ("workflow_events", SIGNAL_COLUMNS, chunk.signals)):
        if lines:
            repo.copy_rows(conn, table, columns, lines, month=chunk.month, skip_row_triggers=skip_row_triggers)
    result.runs += len(chunk.runs)
    result.tasks += len(chunk.tasks)
    result.signals += len(chunk.signals)
    result.active_runs += chunk.active


def backfill(url: str, specs: Mapping[str, WorkflowSpec], versions: Mapping[str, int], options: MonthsOptions,
             *, now: datetime, on_start: Callable[[int], None] | None = None,
             on_progress: Callable[[int, int], None] | None = None) -> MonthsResult:
    """Backfill the ``options.months`` complete months before ``now`` (the database
    clock); months already backfilled with the same seed are skipped.

    Worker processes (``options.processes``) play chunks of runs ahead while this
    thread streams the finished ones, in order, one transaction per month. They are
    started with ``spawn``, which imports the caller's ``__main__`` module again: a
    script calling this must keep its work under ``if __name__ == "__main__":``.
    ``on_start(runs)`` is told how many runs will be written once that is known;
    ``on_progress(runs, task_rows)`` after each chunk reaches the server."""
    started = time.perf_counter()
    months = generated_months(now, options.months)
    sizes = month_sizes(months, options.runs_per_month, options.growth)
    results = {m: MonthResult(month=m) for m in months}
    if not months:
        return MonthsResult(months=[], seconds=0.0)
    application = "composer-ops simulate history"
    with connect(url, application_name=application) as conn:
        ensure_from(conn, date(int(months[0][:4]), int(months[0][4:]), 1), len(months) - 1)
        conn.commit()
        markers = {marker_run_id(options.seed, m): m for m in months}
        for found in repo.existing_runs(conn, list(markers)):
            results[markers[found]].skipped = True
    todo = [m for m in months if not results[m].skipped]
    if on_start is not None:
        on_start(sum(sizes[m] for m in todo))
    ages = dict(zip(months, range(len(months), 0, -1), strict=True))
    jobs = (job for m in todo for job in _jobs(options.seed, m, ages[m], sizes[m], options.chunk_runs))
    processes = options.processes or os.cpu_count() or 1
    pool = ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(specs, versions, options))
    set_based = False
    try:
        with connect(url, application_name=application) as conn:
            set_based = options.set_based_checks and repo.may_skip_row_triggers(conn)
            ahead: deque[Future[_Chunk]] = deque(pool.submit(_generate, job)
                                                 for job in itertools.islice(jobs, 2 * processes))
            while ahead:
                chunk = ahead.popleft().result()
                if (job := next(jobs, None)) is not None:
                    ahead.append(pool.submit(_generate, job))
                _copy(conn, chunk, results[chunk.month], skip_row_triggers=set_based)
                if chunk.last:
                    conn.commit()
                    with autocommit(conn):
                        repo.analyze_month(conn, chunk.month)
                if on_progress is not None:
                    on_progress(len(chunk.runs), len(chunk.tasks))
            # A month is committed after its last chunk only: one cut short (a worker
            # failed, or an interrupt) is rolled back, never left half written for its
            # marker run to make the next backfill skip it.
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return MonthsResult(months=[results[m] for m in months], seconds=time.perf_counter() - started,
                         set_based_checks=set_based)
