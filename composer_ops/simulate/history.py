"""Months of generated history, written with COPY.

For each of the N complete UTC months before the current one, ``backfill`` plays
``runs`` runs of the simulator's workflows through a small discrete-event model of
the engine and writes what the engine would have left behind: one ``workflow_runs``
row per run, one ``task_instances`` row per node reached, ``workflow_events`` rows
for buffered signals. Durations, failures, retries and outputs come from the same
behaviour model the live workers use (:mod:`composer_ops.simulate.model`), and the
graph semantics are the state machine's: SWITCH branches chosen from the resolved
expression and the others SKIPPED, joins once after their last dependency, a failed
node failing the run and cancelling its active tasks, buffered signals consumed
when the node is created, WAIT_FOR_EVENT timeouts.

IDs are UUIDv7 stamped at the instant the row was created (runs within their month),
so every row lands in its month's partition, which is created first with
``composer_ensure_partitions_from``. Everything is drawn from ``random.Random`` seeded
by (seed, month): the same options give byte-identical rows. A month whose first run
(``marker_run_id``) already exists is skipped, so backfilling twice adds nothing.

A few orders in the recent months never get their carrier scan and stay RUNNING,
waiting without a timeout (retention keeps those months); in months older than
``stuck_months`` an operator has cancelled them since.

Throughput: one thread generates rows as COPY text in chunks while another streams
the previous chunk to the server, one transaction per month; every constraint and
index stays in place. Checking the foreign key of each task row by its trigger (one
lookup query per row) costs about two thirds of the server's time, so when the
session may set ``session_replication_role`` (a superuser, as on the embedded
server, or a role granted SET on it) task and signal rows are copied with row
triggers off, the way ``pg_restore --disable-triggers`` loads, and their foreign keys
are checked instead by one query per chunk before the month commits
(``_check_references``): an orphan rolls the month back. Otherwise, or with
``set_based_checks=False``, every row is checked by its trigger.
"""

from __future__ import annotations

import calendar
import json
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime
from typing import Any

import psycopg
from psycopg import sql

from composer_ops.core import RunContext
from composer_ops.core.expressions import Ref, is_ref, parse_ref, resolve, resolve_ref
from composer_ops.core.model import NodeType
from composer_ops.core.retry import retry_decision
from composer_ops.core.spec import NodeSpec, WorkflowSpec
from composer_ops.errors import ComposerError, Invalid
from composer_ops.repo.partitions import ensure_from
from composer_ops.simulate.definitions import WORKFLOW_WEIGHTS, SignalPlan, make_input, plan_cancel, plan_signals
from composer_ops.simulate.model import Behaviour, draw_attempt, task_output

__all__ = ["HistoryOptions", "HistoryResult", "MonthResult", "backfill", "history_months", "marker_run_id",
           "month_sizes"]

INF = math.inf
_RUN_COLUMNS = ("id, workflow_definition_id, workflow_version, status, input_json, context_json, error_json, "
                "output_json, created_at, updated_at, completed_at")
_TASK_COLUMNS = ("id, run_id, node_id, node_type, queue, state, attempt, input_json, output_json, last_error, "
                 "branches, wake_at, event_name, scheduled_at, started_at, finished_at, completed_at, created_at, "
                 "updated_at, lease_owner, lease_expires_at")
_EVENT_COLUMNS = "id, run_id, name, payload, created_at, consumed_at"
_N = "\\N"
#: Relative arrival rate per hour of day (UTC): office hours for people, nights for batches.
_DAY_HOURS = (0.25, 0.2, 0.15, 0.15, 0.2, 0.3, 0.5, 0.9, 1.3, 1.6, 1.7, 1.6, 1.4, 1.5, 1.6, 1.6, 1.5, 1.3,
              1.1, 1.0, 0.9, 0.7, 0.5, 0.35)
_NIGHT_HOURS = (0.3, 1.0, 1.0, 0.6) + (0.0,) * 20
_STUCK_REASON = "stuck for weeks: the carrier never scanned the parcel; cancelled by on-call"


@dataclass(frozen=True, kw_only=True)
class HistoryOptions:
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
    #: Check the task and signal rows' foreign keys with one query per month instead
    #: of one trigger call per row, when the session is allowed to (see ``backfill``).
    set_based_checks: bool = True

    def __post_init__(self) -> None:
        # stuck_months >= 1: an operator's clean-up of older months happens within
        # the month after theirs, so it is always in the past.
        for name, low in (("months", 0), ("runs_per_month", 1), ("stuck_months", 1), ("chunk_runs", 1)):
            if getattr(self, name) < low:
                raise Invalid(f"history {name.replace('_', '-')} must be at least {low}, got {getattr(self, name)}")


@dataclass
class MonthResult:
    month: str
    runs: int = 0
    tasks: int = 0
    events: int = 0
    active_runs: int = 0
    skipped: bool = False


@dataclass
class HistoryResult:
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
        return sum(m.runs + m.tasks + m.events for m in self.months)

    @property
    def task_rows_per_s(self) -> float:
        return self.tasks / self.seconds if self.seconds > 0 else 0.0


def history_months(now: datetime, count: int) -> list[str]:
    """The ``count`` complete UTC months before ``now``'s month, oldest first (YYYYMM)."""
    index = now.astimezone(UTC).year * 12 + now.astimezone(UTC).month - 1
    return [f"{(index - k) // 12:04d}{(index - k) % 12 + 1:02d}" for k in range(count, 0, -1)]


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
    year, mon = int(month[:4]), int(month[4:])
    days = calendar.monthrange(year, mon)[1]
    start = datetime(year, mon, 1, tzinfo=UTC).timestamp()
    return start, start + days * 86_400, days


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


class _Stamps:
    """Fast COPY text for timestamps: the minute prefix is formatted once."""

    def __init__(self) -> None:
        self._minutes: dict[int, str] = {}

    def __call__(self, t: float) -> str:
        sec = int(t)
        minute, second = divmod(sec, 60)
        prefix = self._minutes.get(minute)
        if prefix is None:
            prefix = time.strftime("%Y-%m-%d %H:%M:", time.gmtime(minute * 60))
            self._minutes[minute] = prefix
        return f"{prefix}{second:02d}.{int((t - sec) * 1_000_000):06d}+00"


_encode = json.JSONEncoder(separators=(",", ":")).encode


def _json(value: Any) -> str:
    """A jsonb value as COPY text (backslashes doubled); None is NULL."""
    if value is None:
        return _N
    return _encode(value).replace("\\", "\\\\")


class _Template:
    """A TASK input template compiled once. A flat object of references and literals
    (every template the simulator deploys) resolves in one comprehension, with the
    same result as :func:`composer_ops.core.expressions.resolve`; anything else falls
    back to it."""

    __slots__ = ("template", "flat")

    def __init__(self, template: Any) -> None:
        self.template = template
        self.flat: list[tuple[str, Ref | None, Any]] | None = None
        if isinstance(template, dict) and not any(isinstance(v, dict | list) for v in template.values()):
            self.flat = [(k, parse_ref(v) if is_ref(v) else None, v) for k, v in template.items()]

    def __call__(self, ctx: RunContext, outputs: Mapping[str, Any]) -> Any:
        if self.flat is None:
            return resolve(self.template, ctx, outputs)
        return {k: v if ref is None else resolve_ref(ref, ctx, outputs) for k, ref, v in self.flat}


def _seconds(value: float) -> str:
    return f"{int(value)}s" if float(value).is_integer() else f"{value}s"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()



class _Node:
    """One node's fate in a simulated run (times are epoch seconds; INF = never)."""

    __slots__ = ("spec", "task_id", "created", "end", "state", "attempts", "output", "error", "input", "wake_at",
                 "event", "branches")

    def __init__(self, spec: NodeSpec, task_id: str, created: float) -> None:
        self.spec = spec
        self.task_id = task_id
        self.created = created
        self.end = created
        self.state = "COMPLETED"
        self.attempts: list[tuple[float, float, str | None]] = []   # (claimed, ended, error)
        self.output: Any = None
        self.error: str | None = None
        self.input: Any = None
        self.wake_at: float | None = None
        self.event: str | None = None
        self.branches: tuple[str, ...] | None = None


@dataclass
class _Chunk:
    month: str
    runs: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    active: int = 0


_Signal = tuple[float, str, Any, "str | None"]   # (arrival, name, payload, node that consumes it on creation)


class _MonthGenerator:
    """Plays one month's runs; ``chunks()`` yields their rows as COPY text."""

    def __init__(self, *, month: str, age: int, runs: int, options: HistoryOptions,
                 specs: Mapping[str, WorkflowSpec], versions: Mapping[str, int], stamps: _Stamps) -> None:
        self.month, self.age, self.runs = month, age, runs
        self.seed, self.options, self.behaviour = options.seed, options, options.behaviour
        self.specs, self.versions, self.ts = specs, versions, stamps
        self.start, self.end, self.days = _month_bounds(month)
        self.rng = random.Random(f"composer-sim-history:{options.seed}:{month}")
        self.scale = self.behaviour.time_scale
        self.configs = {wf: _json(dict(spec.config)) for wf, spec in specs.items()}
        self.templates = {(wf, n.id): _Template(n.input) for wf, spec in specs.items() for n in spec.nodes.values()
                          if n.type is NodeType.TASK}

    def _arrivals(self) -> list[tuple[float, str]]:
        """Start instants and workflows of the month's runs (after the first), in time order."""
        rng, start = self.rng, self.start
        names = list(WORKFLOW_WEIGHTS)
        cum_wf = list(_cumulative(WORKFLOW_WEIGHTS.values()))
        year, mon = int(self.month[:4]), int(self.month[4:])
        cum_days = list(_cumulative(0.55 if calendar.weekday(year, mon, d + 1) >= 5 else 1.0
                                    for d in range(self.days)))
        cum_day_hours, cum_night_hours = list(_cumulative(_DAY_HOURS)), list(_cumulative(_NIGHT_HOURS))
        days, hours = range(self.days), range(24)
        out: list[tuple[float, str]] = []
        for _ in range(self.runs - 1):
            wf = rng.choices(names, cum_weights=cum_wf)[0]
            day = rng.choices(days, cum_weights=cum_days)[0]
            hour = rng.choices(hours, cum_weights=cum_night_hours if wf == "nightly-batch" else cum_day_hours)[0]
            out.append((start + day * 86_400 + hour * 3_600 + rng.random() * 3_600, wf))
        out.sort()
        return out

    def chunks(self) -> Iterator[_Chunk]:
        marker = _marker_rng(self.seed, self.month)
        chunk = _Chunk(self.month)
        # The month's first run, an order the carrier never scans, is the idempotency marker.
        self._run(chunk, marker, "order-fulfilment", _marker_start(marker, self.month), f"h{self.month}-0",
                  stuck=True)
        for i, (t0, wf) in enumerate(self._arrivals(), start=1):
            self._run(chunk, self.rng, wf, t0, f"h{self.month}-{i}", stuck=False)
            if len(chunk.runs) >= self.options.chunk_runs:
                yield chunk
                chunk = _Chunk(self.month)
        if chunk.runs:
            yield chunk

    # -- one run ----------------------------------------------------------------------

    def _run(self, chunk: _Chunk, rng: random.Random, wf: str, t0: float, key: str, *, stuck: bool) -> None:
        spec = self.specs[wf]
        run_id = _uuid7(int(t0 * 1000), rng)
        run_input = make_input(rng, wf, {"seed": self.seed, "run": key}, t0, self.scale)
        ctx = RunContext(input=run_input, config=spec.config)
        plans = {p.event: p for p in plan_signals(rng, wf, self.scale)}
        if stuck:
            plans = {name: replace(p, timing="never", duplicate_after_s=None) for name, p in plans.items()}
        cancel = plan_cancel(rng, self.options.cancel_rate, self.scale)
        nodes: dict[str, _Node] = {}
        outputs: dict[str, Any] = {}
        fails: list[tuple[float, str, str]] = []      # (when, run error, node)
        signals: list[_Signal] = []
        for node_id in spec.topological_order():
            ns = spec.nodes[node_id]
            created = t0
            if ns.depends_on:
                deps = [nodes.get(d) for d in ns.depends_on]
                if any(d is None or d.end == INF for d in deps):
                    continue                      # blocked behind a node that never finishes
                created = max(d.end for d in deps if d is not None)
                skip = not any(_live(d, node_id) for d in deps if d is not None)
            else:
                skip = False
            node = nodes[node_id] = _Node(ns, _uuid7(int(created * 1000), rng), created)
            if skip:
                node.state = "SKIPPED"
            elif ns.type is NodeType.TASK:
                self._task(wf, node, rng, ctx, outputs, fails)
            elif ns.type is NodeType.SWITCH:
                assert ns.expression is not None
                value = resolve_ref(parse_ref(ns.expression), ctx, outputs)
                label = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
                node.branches = tuple(ns.cases.get(label, ns.default))
                node.output = {"value": value, "branches": list(node.branches)}
            elif ns.type is NodeType.WAIT:
                wake = created + ns.duration_s if ns.duration_s is not None else _until(ns, ctx, outputs, created)
                node.wake_at = wake
                node.end = max(wake, created) + rng.uniform(0.01, 0.5)
            else:
                self._wait_for_event(node, rng, t0, plans, fails, signals)
            if node.state == "COMPLETED":
                outputs[node_id] = node.output

        t_fail, fail_reason, failing = min(fails) if fails else (INF, "", "")
        complete = len(nodes) == len(spec.nodes) and all(n.end != INF for n in nodes.values())
        natural = max(n.end for n in nodes.values()) if complete else INF
        t_cancel, cancel_reason = (t0 + cancel[0], cancel[1]) if cancel else (INF, "")
        if natural == INF and t_fail == INF and t_cancel == INF and self.age > self.options.stuck_months:
            t_cancel, cancel_reason = self.end + rng.uniform(0.5, 9.5) * 86_400, _STUCK_REASON
        t_end = min(t_fail, t_cancel, natural)
        reason: str | None = None
        if t_end == INF:
            status = "RUNNING"
        elif t_end == t_fail:
            status, reason = "FAILED", fail_reason
        elif t_end == t_cancel:
            status, reason = "CANCELLED", cancel_reason
        else:
            status = "SUCCEEDED"

        finished = status in ("FAILED", "CANCELLED")
        task_reason = f"run failed: {reason}" if status == "FAILED" else reason
        for node_id, node in nodes.items():
            if finished and node.created >= t_end and node_id != failing:
                continue                          # the run ended before this node was reached
            if finished and node.end > t_end:
                chunk.tasks.append(self._cancelled_row(run_id, node, t_end, task_reason))
            else:
                chunk.tasks.append(self._task_row(run_id, node))
        for arrival, name, payload, consumer in signals:
            if arrival >= t_end:
                continue                          # the run had finished: the signal was refused
            target = nodes.get(consumer) if consumer else None
            consumed = self.ts(target.created) if target is not None and target.created < t_end else _N
            chunk.events.append("\t".join((_uuid7(int(arrival * 1000), rng), run_id, name, _json(payload),
                                           self.ts(arrival), consumed)) + "\n")

        output = {sink: outputs.get(sink) for sink in spec.sinks()} if status == "SUCCEEDED" else None
        ts = self.ts
        done = ts(t_end) if t_end != INF else _N
        input_json = _json(run_input)
        chunk.runs.append("\t".join((
            run_id, wf, str(self.versions[wf]), status, input_json,
            f'{{"input":{input_json},"config":{self.configs[wf]}}}',
            _json({"error": reason}) if reason else _N, _json(output), ts(t0),
            ts(t0) if t_end == INF else done, done)) + "\n")
        chunk.active += status == "RUNNING"

    def _task(self, wf: str, node: _Node, rng: random.Random, ctx: RunContext, outputs: Mapping[str, Any],
              fails: list[tuple[float, str, str]]) -> None:
        """Attempts of a TASK node: dispatch, run (or die with its worker), retry with backoff."""
        ns = node.spec
        task = ns.task or ns.id
        node.input = self.templates[(wf, ns.id)](ctx, outputs)
        available, attempt, behaviour = node.created, 0, self.behaviour
        error: str | None
        while True:
            claimed = available + min(rng.lognormvariate(-4.2, 0.8), 2.0)
            if rng.random() < behaviour.crash_rate:
                expires = claimed + ns.lease_s
                ended = expires + rng.uniform(0.05, 0.6)          # the sweeper's lag
                owner = f"sim-w{rng.randint(1, 4)}:{rng.randint(1000, 60000)}"
                outcome, error = "transient", f"lease of {owner} expired at {_iso(expires)}"
            else:
                draw = draw_attempt(rng, behaviour, task)
                ended = claimed + draw.duration_s + 0.004
                outcome, error = draw.outcome, draw.error_text
            node.attempts.append((claimed, ended, error))
            node.end = ended
            if outcome == "ok":
                node.output = task_output(task, node.input, rng)
                return
            delay = retry_decision(ns.retry, attempt, outcome == "transient")
            if delay is None:
                node.state, node.error = "FAILED", error
                if not ns.optional:
                    tried = f"after {attempt + 1} attempts" if attempt else "after 1 attempt"
                    fails.append((ended, f"node {json.dumps(ns.id)} failed {tried}: {error}", ns.id))
                return
            available, attempt = ended + delay, attempt + 1

    def _wait_for_event(self, node: _Node, rng: random.Random, t0: float, plans: Mapping[str, SignalPlan],
                        fails: list[tuple[float, str, str]], signals: list[_Signal]) -> None:
        """A WAIT_FOR_EVENT node: consumes a buffered signal, is resolved by one, or times out."""
        ns, created = node.spec, node.created
        assert ns.event is not None
        node.event = ns.event
        deadline = created + ns.timeout_s if ns.timeout_s is not None else None
        fires = deadline + rng.uniform(0.01, 0.5) if deadline is not None else INF
        plan = plans.get(ns.event)
        arrival: float | None = None
        if plan is not None and plan.timing == "early":
            arrival = t0 + plan.delay_s
        elif plan is not None and plan.timing in ("late", "too_late"):
            arrival = created + plan.delay_s
        if plan is not None and arrival is not None and arrival < fires:
            node.output = plan.payload
            if arrival <= created:
                signals.append((arrival, ns.event, plan.payload, ns.id))
            else:
                node.wake_at, node.end = deadline, arrival
            if plan.duplicate_after_s is not None:
                signals.append((node.end + plan.duplicate_after_s, ns.event, plan.payload, None))
            return
        node.wake_at = deadline
        if deadline is None:
            node.state, node.end = "WAITING", INF
            return
        node.end = fires
        if plan is not None and arrival is not None:
            signals.append((arrival, ns.event, plan.payload, None))
        if ns.on_timeout == "continue":
            return
        node.state = "FAILED"
        node.error = f"timed out waiting for event {json.dumps(ns.event)} after {_seconds(ns.timeout_s or 0)}"
        if not ns.optional:
            fails.append((fires, f"node {json.dumps(ns.id)} failed: {node.error}", ns.id))

    # -- rows ---------------------------------------------------------------------------

    def _task_row(self, run_id: str, node: _Node) -> str:
        """The row the engine leaves for a node that reached ``node.state`` by itself."""
        ts, ns, state = self.ts, node.spec, node.state
        is_task = ns.type is NodeType.TASK
        if state in ("SKIPPED", "WAITING"):
            created = ts(node.created)
            return self._row(run_id, node, state=state, attempt=0, input_=_N, output=_N, error=_N, started=_N,
                             finished=created if state == "SKIPPED" else _N, completed=_N, updated=created)
        attempts = node.attempts
        # A completion keeps the error of the attempt before it; a failure records its own.
        error = attempts[-2][2] if state == "COMPLETED" and len(attempts) > 1 else node.error
        end = ts(node.end)
        return self._row(run_id, node, state=state, attempt=max(len(attempts) - 1, 0),
                         input_=_json(node.input) if is_task else _N, output=_json(node.output),
                         error=_json({"error": error}) if error else _N,
                         started=ts(attempts[-1][0]) if attempts else _N, finished=end,
                         completed=end if state == "COMPLETED" else _N, updated=end)

    def _cancelled_row(self, run_id: str, node: _Node, at: float, reason: str | None) -> str:
        """The row of a node still active when the run failed or was cancelled at ``at``."""
        ts = self.ts
        attempt, started = 0, _N
        if node.spec.type is NodeType.TASK:
            attempt = sum(1 for _, ended, _ in node.attempts if ended <= at)
            if attempt < len(node.attempts) and node.attempts[attempt][0] <= at:
                started = ts(node.attempts[attempt][0])
        stamp = ts(at)
        return self._row(run_id, node, state="CANCELLED", attempt=attempt,
                         input_=_json(node.input) if node.spec.type is NodeType.TASK else _N, output=_N,
                         error=_json({"error": reason}) if reason else _N, started=started, finished=stamp,
                         completed=_N, updated=stamp)

    def _row(self, run_id: str, node: _Node, *, state: str, attempt: int, input_: str, output: str, error: str,
             started: str, finished: str, completed: str, updated: str) -> str:
        ns = node.spec
        queue_ = (ns.queue or "default") if ns.type is NodeType.TASK else _N
        created = self.ts(node.created)
        return "\t".join((
            node.task_id, run_id, ns.id, str(ns.type), queue_, state, str(attempt), input_, output, error,
            "{" + ",".join(node.branches) + "}" if node.branches is not None else _N,
            self.ts(node.wake_at) if node.wake_at is not None else _N, node.event or _N,
            created, started, finished, completed, created, updated, _N, _N)) + "\n"


def _live(dep: _Node, node_id: str) -> bool:
    """The machine's rule: whether a terminal dependency lets ``node_id`` run rather than be skipped."""
    if dep.state == "COMPLETED" or (dep.state == "FAILED" and dep.spec.optional):
        return dep.spec.type is not NodeType.SWITCH or node_id in (dep.branches or ())
    return False


def _until(ns: NodeSpec, ctx: RunContext, outputs: Mapping[str, Any], created: float) -> float:
    value: Any = ns.until
    if isinstance(value, str) and value.startswith("$."):
        value = resolve_ref(parse_ref(value), ctx, outputs)
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return created


def _cumulative(weights: Iterable[float]) -> Iterator[float]:
    total = 0.0
    for w in weights:
        total += w
        yield total


# -- writing ------------------------------------------------------------------------------


class _Copier(threading.Thread):
    """Streams chunks to the server with COPY while the caller generates the next one."""

    def __init__(self, url: str, results: Mapping[str, MonthResult],
                 on_progress: Callable[[int, int], None] | None, *, set_based: bool) -> None:
        super().__init__(name="composer-sim-copy", daemon=True)
        self.url, self.results, self.on_progress = url, results, on_progress
        self.items: queue.Queue[_Chunk | str | None] = queue.Queue(maxsize=3)
        self.error: BaseException | None = None
        self.set_based = set_based

    def put(self, item: _Chunk | str | None) -> None:
        while True:
            self._raise()
            try:
                self.items.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        if self.is_alive():
            self.put(None)
            self.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise ComposerError(f"history backfill failed: {str(self.error).strip().splitlines()[0]}") \
                from self.error

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, application_name="composer-ops simulate history") as conn:
                self.set_based = self.set_based and _may_skip_row_triggers(conn)
                while (item := self.items.get()) is not None:
                    if isinstance(item, str):
                        conn.commit()
                        _analyze(conn, item)
                    else:
                        self._copy(conn, item)
                # Anything after the last month's commit is a month cut short (the
                # generator failed or was interrupted): never commit half a month,
                # its marker run would make the next backfill skip it.
                conn.rollback()
        except BaseException as exc:  # handed to the generating thread, which raises it
            self.error = exc

    def _copy(self, conn: psycopg.Connection[Any], chunk: _Chunk) -> None:
        with conn.cursor() as cur:
            for table, columns, lines in (("workflow_runs", _RUN_COLUMNS, chunk.runs),
                                          ("task_instances", _TASK_COLUMNS, chunk.tasks),
                                          ("workflow_events", _EVENT_COLUMNS, chunk.events)):
                if not lines:
                    continue
                # Runs keep their per-row check (against the definitions); the rows
                # that reference them are checked per month, see _check_references.
                if self.set_based and table != "workflow_runs":
                    cur.execute("SET LOCAL session_replication_role = replica")
                with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(
                        sql.Identifier(table), sql.SQL(columns))) as copy:
                    copy.write("".join(lines))
                if self.set_based and table != "workflow_runs":
                    cur.execute("SET LOCAL session_replication_role = origin")
                    _check_references(cur, table, chunk.month, lines)
        result = self.results[chunk.month]
        result.runs += len(chunk.runs)
        result.tasks += len(chunk.tasks)
        result.events += len(chunk.events)
        result.active_runs += chunk.active
        if self.on_progress:
            self.on_progress(len(chunk.runs), len(chunk.tasks))


def _may_skip_row_triggers(conn: psycopg.Connection[Any]) -> bool:
    """Whether this session may set ``session_replication_role`` (a superuser, or a
    role granted SET on it); otherwise every row is checked by its trigger."""
    try:
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
    except psycopg.errors.InsufficientPrivilege:
        return False
    finally:
        conn.rollback()
    return True


def _check_references(cur: psycopg.Cursor[Any], table: str, month: str, lines: list[str]) -> None:
    """The foreign key of rows just copied without their triggers, checked in bulk:
    every run ID they reference (their second column) must be a run of the month.
    One query probing the runs' primary key once per distinct run, instead of one
    trigger call per row. The month's partitions are locked by this transaction's
    inserts, so no run can be dropped between this check and the commit."""
    referenced = sorted({line.split("\t", 2)[1] for line in lines})
    row = cur.execute(sql.SQL("SELECT count(*) FROM unnest(%s::text[]) AS c(run_id) "
                              "WHERE NOT EXISTS (SELECT 1 FROM {} r WHERE r.id = c.run_id)").format(
                          sql.Identifier(f"workflow_runs_p{month}")), (referenced,)).fetchone()
    if row is None or row[0]:
        raise ComposerError(f"{table}: {row[0] if row else '?'} rows of month {month} reference no run; "
                            "the month was rolled back")


def _analyze(conn: psycopg.Connection[Any], month: str) -> None:
    """Fresh statistics for the month's partitions (row estimates for the notebooks)."""
    conn.autocommit = True
    try:
        for table in ("workflow_runs", "task_instances", "workflow_events"):
            conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(f"{table}_p{month}")))
    finally:
        conn.autocommit = False


def backfill(url: str, specs: Mapping[str, WorkflowSpec], versions: Mapping[str, int], options: HistoryOptions,
             *, now: datetime, on_start: Callable[[int], None] | None = None,
             on_progress: Callable[[int, int], None] | None = None) -> HistoryResult:
    """Backfill the ``options.months`` complete months before ``now`` (the database
    clock); months already backfilled with the same seed are skipped.

    ``on_start(runs)`` is told how many runs will be written once that is known;
    ``on_progress(runs, task_rows)`` after each chunk reaches the server."""
    started = time.perf_counter()
    months = history_months(now, options.months)
    sizes = month_sizes(months, options.runs_per_month, options.growth)
    results = {m: MonthResult(month=m) for m in months}
    if not months:
        return HistoryResult(months=[], seconds=0.0)
    with psycopg.connect(url, application_name="composer-ops simulate history") as conn:
        ensure_from(conn, date(int(months[0][:4]), int(months[0][4:]), 1), len(months) - 1)
        conn.commit()
        for month in months:
            found = conn.execute("SELECT 1 FROM workflow_runs WHERE id = %s",
                                 (marker_run_id(options.seed, month),)).fetchone()
            results[month].skipped = found is not None
    if on_start is not None:
        on_start(sum(sizes[m] for m in months if not results[m].skipped))
    copier = _Copier(url, results, on_progress, set_based=options.set_based_checks)
    copier.start()
    stamps = _Stamps()
    try:
        for age, month in zip(range(len(months), 0, -1), months, strict=True):
            if results[month].skipped:
                continue
            generator = _MonthGenerator(month=month, age=age, runs=sizes[month], options=options, specs=specs,
                                        versions=versions, stamps=stamps)
            for chunk in generator.chunks():
                copier.put(chunk)
            copier.put(month)
    finally:
        copier.finish()
    return HistoryResult(months=[results[m] for m in months], seconds=time.perf_counter() - started,
                         set_based_checks=copier.set_based)
