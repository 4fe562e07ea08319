"""Drive the chaos run: start runs, signal and cancel them, SIGKILL workers and
coordinators and restart PostgreSQL once, then audit the database.

``python -m tests.chaos.driver --runs 5000`` (``make chaos``) uses the suite's server
(:func:`composer_ops.testing.servers.session`: COMPOSER_DATABASE_URL, else
COMPOSER_TEST_PGBIN, else the embedded one) and a fresh database on it; it prints the figures and exits 1 if
anything was lost. With COMPOSER_DATABASE_URL the server restart is skipped (the
server is not ours to restart), and the report says so.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import logging
import os
import random
import re
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from composer_ops import Conflict, Engine
from composer_ops.engine.ids import uuid7_at
from composer_ops.errors import Transient, Unavailable
from composer_ops.testing import servers
from composer_ops.testing.processes import Fleet, Proc
from tests.chaos.hook import SECRET, Hook
from tests.chaos.verify import AUDIT_SQL, AUDIT_SQL_CITUS, TERMINAL, Audit, audit, describe_stuck, owner_pid
from tests.chaos.workload import LEASE_S, Planned, plan, specs

T = TypeVar("T")


@dataclass
class Options:
    runs: int = 200
    seed: int = 7
    workers: int = 3
    coordinators: int = 2
    concurrency: int = 6
    start_rate: float = 25.0          # runs started per second
    kill_every: tuple[float, float] = (0.5, 1.2)
    kill_after_starts_s: float = 4.0   # keep killing this long into the drain
    restart: bool = True
    timeout_s: float = 600.0


@dataclass
class Report:
    options: Options
    audit: Audit
    kills: dict[str, int]
    restarts: list[float]
    restart_note: str
    crashes: list[str]
    client_retries: dict[str, int]
    logs: dict[str, Any]
    elapsed_s: float
    engine_retries: int = 0
    stuck: list[str] = field(default_factory=list)
    busy_kills: int = 0               # worker kills chosen among workers holding a running task
    unclassed: list[str] = field(default_factory=list)   # client errors retried that were not Transient/Unavailable

    @property
    def ok(self) -> bool:
        return not self.audit.problems and not self.stuck and not self.crashes

    def lines(self) -> list[str]:
        f = self.audit.figures
        sig, hooks, req = f.get("signals", {}), f.get("webhooks", {}), f.get("requeues", {})
        rec = f.get("recovery_after_worker_kill_s", {})
        lost = len(self.stuck) + sig.get("lost", 0) + sig.get("doubled", 0) + hooks.get("missing", 0)
        out = [
            f"chaos: {f.get('runs', 0)} runs in {self.elapsed_s:.1f}s {f.get('by_status', {})}",
            f"  kills: {sum(self.kills.values())} {self.kills}, {self.busy_kills} of a worker running a task; "
            f"server restarts: {len(self.restarts)} "
            f"({self.restart_note})",
            f"  retries: {sum(req.values())} {req}; runs failed by lease expiry alone: "
            f"{f.get('failed_by_lease_expiry')}; history: {f.get('history')}",
            f"  recovery after a worker kill (lease {LEASE_S}s): task re-queued after {rec.get('requeued_median')}s "
            f"median / {rec.get('requeued_max')}s max, running again after {rec.get('running_again_median')}s / "
            f"{rec.get('running_again_max')}s (includes waiting in the queue)",
            f"  after the server restart: first task completed {f.get('first_completion_after_restart_s')}s after "
            f"it was back; transient database errors retried inside the engine: {self.engine_retries} in the "
            f"driver, {self.logs.get('retried')} in the workers and coordinators",
            f"  signals: {sig}",
            f"  webhooks: {hooks}",
            f"  client retries (transient errors seen by the driver): {self.client_retries}",
            f"  of them not classed transient or unavailable: {len(self.unclassed)}"
            + "".join(f"\n    {u}" for u in self.unclassed[:5]),
            f"  processes: stale results dropped {self.logs.get('stale')}, leases lost {self.logs.get('lease_lost')}, "
            f"unexpected exits {len(self.crashes)}",
            f"  tracebacks logged: {self.logs.get('tracebacks') or 'none'}",
            f"  lost: {lost} (runs stuck {len(self.stuck)}, signals lost {sig.get('lost', 0)} / doubled "
            f"{sig.get('doubled', 0)}, webhooks missing {hooks.get('missing', 0)}); "
            f"problems: {len(self.audit.problems)}",
        ]
        out += [f"  PROBLEM: {p}" for p in self.audit.problems[:30]]
        out += [f"  CRASH: {c}" for c in self.crashes[:10]]
        out += [f"  STUCK: {s}" for s in self.stuck[:5]]
        return out


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


Fault = Callable[[], str]


def restart_server(server: servers.Server) -> Fault:
    """The single-server fault: ``pg_ctl restart -m fast``; returns its description."""
    def fault() -> str:
        return f"pg_ctl restart -m fast, down {server.restart():.2f}s"
    return fault


class Chaos:
    def __init__(self, db_url: str, options: Options, logdir: Path, *, fault: Fault | None = None) -> None:
        self.db_url, self.o = db_url, options
        self.fault = fault
        self.rng = random.Random(options.seed)
        self.hook = Hook()
        self.fleet = Fleet(db_url, logdir=logdir, env={
            **os.environ, "COMPOSER_LOG_LEVEL": "INFO", "COMPOSER_WEBHOOK_SECRET": SECRET,
            "COMPOSER_WEBHOOK_CONNECT_TIMEOUT_S": "1", "COMPOSER_WEBHOOK_TIMEOUT_S": "1",
            "COMPOSER_WEBHOOK_DEADLINE_S": "1.5"})
        self.engine = Engine.connect(db_url, pool_size=4, application_name="chaos-driver")
        self.started: dict[str, Planned] = {}
        self.sent: dict[str, list[str]] = {}
        self.retries = {"start": 0, "signal": 0, "cancel": 0}
        self.error_types: Counter[str] = Counter()
        self.restarts: list[tuple[float, float]] = []
        self.restart_note = "not attempted"
        self.engine_retries = 0
        self.errors: list[str] = []
        self._agenda: list[tuple[float, int, Callable[[], None]]] = []
        self._agenda_lock = threading.Lock()
        self._seq = 0
        self._starting_done = threading.Event()
        self._starts_ended: float | None = None
        self._stop = threading.Event()
        self.busy_kills = 0          # kills of a worker that held a running task when chosen
        self.unclassed: list[str] = []

    # -- client calls, retried through the faults ----------------------------------

    def _call(self, what: str, fn: Callable[[], T], *, conflict_ok_on_retry: bool = False) -> T | None:
        attempt = 0
        deadline = time.monotonic() + 120
        while True:
            try:
                return fn()
            except Conflict:
                if attempt and conflict_ok_on_retry:
                    return None       # our earlier attempt committed before the connection dropped
                raise
            except Exception as exc:  # Unavailable, or a driver error the engine let through
                self.error_types[f"{what}: {type(exc).__module__}.{type(exc).__name__}"] += 1
                if not isinstance(exc, Transient | Unavailable):
                    self.unclassed.append(f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                if time.monotonic() > deadline:
                    self.errors.append(f"{what}: gave up: {exc}")
                    return None
                self.retries[what] += 1
                attempt += 1
                time.sleep(min(1.0, 0.05 * 2 ** attempt))

    def _start_one(self) -> None:
        want = plan(self.rng)
        run_id = uuid7_at(datetime.now(UTC))
        self._call("start", lambda: self.engine.start(want.workflow, input=want.input, run_id=run_id),
                   conflict_ok_on_retry=True)
        self.started[run_id] = want
        now = time.monotonic()
        if want.signals:
            self.sent[run_id] = []
            for _ in range(want.signals):
                self._schedule(now + self.rng.uniform(0.0, 2.0), functools.partial(self._signal, run_id))
        if want.cancel:
            self._schedule(now + self.rng.uniform(0.2, 2.0), functools.partial(self._cancel, run_id))

    def _signal(self, run_id: str) -> None:
        sig = uuid.uuid4().hex
        self._call("signal", lambda: self.engine.signal(run_id, "go", {"sig": sig}))
        self.sent[run_id].append(sig)

    def _cancel(self, run_id: str) -> None:
        self._call("cancel", lambda: self.engine.cancel(run_id, reason="chaos cancel"), conflict_ok_on_retry=True)

    def _schedule(self, at: float, action: Callable[[], None]) -> None:
        with self._agenda_lock:
            self._seq += 1
            heapq.heappush(self._agenda, (at, self._seq, action))

    # -- threads ---------------------------------------------------------------------

    def _starter(self) -> None:
        begin = time.monotonic()
        for i in range(self.o.runs):
            delay = begin + i / self.o.start_rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self._start_one()
        self._starts_ended = time.monotonic()
        self._starting_done.set()

    def _agenda_loop(self) -> None:
        while not self._stop.is_set():
            with self._agenda_lock:
                due = self._agenda[0][2] if self._agenda and self._agenda[0][0] <= time.monotonic() else None
                if due is not None:
                    heapq.heappop(self._agenda)
            if due is None:
                time.sleep(0.02)
            else:
                due()

    def _killing(self) -> bool:
        """Until the starts end, then ``kill_after_starts_s`` more, and on (until the run is
        over) while no worker holding a running task has been killed yet."""
        if self._stop.is_set():
            return False
        return (self._starts_ended is None or time.monotonic() - self._starts_ended < self.o.kill_after_starts_s
                or not self.busy_kills)

    def _busy_workers(self) -> list[Proc] | None:
        """The live workers holding a RUNNING task's lease; None when the database cannot
        say (a server down for the fault)."""
        workers = self.fleet.alive("worker")
        try:
            with psycopg.connect(self.db_url, autocommit=True, connect_timeout=2) as conn:
                owners = conn.execute("SELECT DISTINCT lease_owner FROM task_instances "
                                      "WHERE state = 'RUNNING'").fetchall()
        except psycopg.Error:
            return None
        pids = {owner_pid(row[0]) for row in owners}
        return [w for w in workers if w.pid in pids]

    def _killer(self) -> None:
        while self._killing():
            time.sleep(self.rng.uniform(*self.o.kill_every))
            self.fleet.reap()
            if self.o.restart and not self.restarts and len(self.started) >= self.o.runs // 2:
                self._restart()
                continue
            roll = self.rng.random()
            if roll < 0.65:
                # A worker holding running tasks, when one does: a random one, on a loaded
                # machine, is often a replacement still starting, and its kill hits nothing.
                busy = self._busy_workers()
                victims = busy or self.fleet.alive("worker")
                victims = [self.rng.choice(victims)] if victims else []
                self.busy_kills += bool(busy)
            elif roll < 0.9:
                coordinators = self.fleet.alive("coordinator")
                victims = [self.rng.choice(coordinators)] if coordinators else []
            else:
                victims = self.fleet.alive("coordinator")        # every coordinator at once
            for proc in victims:
                self.fleet.kill(proc, replace=True)

    def _restart(self) -> None:
        assert self.fault is not None
        t0 = time.time()
        self.restart_note = self.fault()
        self.restarts.append((t0, time.time()))

    # -- the run ---------------------------------------------------------------------

    def run(self) -> Report:
        retried = _Count()
        retry_log = logging.getLogger("composer_ops.db.retry")
        retry_log.addHandler(retried)
        try:
            report = self._run()
        finally:
            retry_log.removeHandler(retried)
        report.engine_retries = retried.count
        return report

    def _run(self) -> Report:
        began = time.monotonic()
        if self.o.restart and self.fault is None:
            self.restart_note = "skipped: the server comes from COMPOSER_DATABASE_URL"
            self.o.restart = False
        elif not self.o.restart:
            self.restart_note = "skipped by request"
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            citus = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')").fetchone()
            with conn.transaction():
                for statement in AUDIT_SQL_CITUS if citus and citus[0] else [AUDIT_SQL]:
                    conn.execute(statement.encode())
        for spec in specs(self.hook.base):
            self.engine.deploy(spec)
        for _ in range(self.o.workers):
            self.fleet.worker(concurrency=self.o.concurrency)
        for _ in range(self.o.coordinators):
            self.fleet.coordinator()
        threads = [threading.Thread(target=t, daemon=True, name=t.__name__)
                   for t in (self._starter, self._agenda_loop, self._killer)]
        for t in threads:
            t.start()
        stuck = self._wait_until_done(began)
        self._stop.set()
        for t in threads:
            t.join(30)
        self.fleet.stop()
        self.hook.close()
        with psycopg.connect(self.db_url) as conn:
            result = audit(conn, self.started, self.sent, self.fleet.kills, self.restarts, self.hook)
            stuck_text = describe_stuck(conn, stuck).splitlines() if stuck else []
        self.engine.close()
        for e in self.errors:
            result.problem(e)
        crashes = [f"{p.kind} pid {p.pid} exited {code}: {p.log.read_text(errors='replace')[-600:]!r}"
                   for p, code in self.fleet.crashes]
        kills: dict[str, int] = {}
        for k in self.fleet.kills:
            kills[k.kind] = kills.get(k.kind, 0) + 1
        report = Report(self.o, result, kills, [t1 - t0 for t0, t1 in self.restarts], self.restart_note, crashes,
                        {**self.retries, **self.error_types}, log_summary(self.fleet.logdir), time.monotonic() - began,
                        stuck=stuck_text, busy_kills=self.busy_kills, unclassed=self.unclassed)
        return report

    def _wait_until_done(self, began: float) -> list[str]:
        """Until every run is terminal and every webhook delivered; returns runs still open."""
        open_runs: list[str] = []
        while time.monotonic() - began < self.o.timeout_s:
            time.sleep(0.5)
            self.fleet.reap()
            if not self._starting_done.is_set() or (self.o.restart and not self.restarts):
                continue
            with self._agenda_lock:
                if self._agenda:
                    continue
            try:
                with psycopg.connect(self.db_url) as conn:
                    rows = conn.execute("SELECT id, status FROM workflow_runs").fetchall()
                    undelivered = conn.execute(
                        "SELECT count(*) FROM webhook_deliveries WHERE delivered_at IS NULL").fetchone()
            except psycopg.OperationalError:
                continue
            status: dict[str, str] = {str(r[0]): str(r[1]) for r in rows}
            open_runs = [r for r in self.started if status.get(r) not in TERMINAL]
            if not open_runs and undelivered is not None and undelivered[0] == 0 and len(status) >= len(self.started):
                return []
        return open_runs


def ci_options(*, start_rate: float, timeout_s: float) -> Options:
    """The CI-size run of the test suites: COMPOSER_CHAOS_RUNS runs (200) from seed
    COMPOSER_CHAOS_SEED (7)."""
    return Options(runs=int(os.environ.get("COMPOSER_CHAOS_RUNS", "200")),
                   seed=int(os.environ.get("COMPOSER_CHAOS_SEED", "7")), start_rate=start_rate, timeout_s=timeout_s)


def assert_nothing_lost(report: Report, *, restarts: int) -> None:
    """The verdict of a CI-size run: the audit found nothing lost or stuck, every run
    was started, the kills (at least 5) hit running tasks, and the database-side
    fault happened ``restarts`` times."""
    assert report.ok, "\n".join(report.lines())
    figures = report.audit.figures
    assert figures["runs"] == report.options.runs and sum(report.kills.values()) >= 5
    assert len(report.restarts) == restarts
    assert figures["requeues"].get("lease expired: worker killed", 0) > 0      # the kills did hit running tasks


def run_chaos(server: servers.Server, options: Options, *, template: str | None = None,
              keep_logs: Path | None = None) -> Report:
    """Create a database on ``server`` (from ``template`` when given, else migrated now),
    run, drop it."""
    from composer_ops.db.migrate import migrate

    name = f"composer_chaos_{uuid.uuid4().hex[:8]}"
    db_url = server.create_database(name, template=template)
    try:
        if not template:
            migrate(db_url)
        return run_chaos_on(db_url, options, fault=restart_server(server) if server.owned else None,
                            keep_logs=keep_logs)
    finally:
        server.drop_database(name)


def run_chaos_on(db_url: str, options: Options, *, fault: Fault | None, keep_logs: Path | None = None) -> Report:
    """Run on the migrated database ``db_url``; ``fault`` (once, half-way through the
    starts) is the database-side fault, None when there is none to cause."""
    if keep_logs is not None:
        keep_logs.mkdir(parents=True, exist_ok=True)
        return Chaos(db_url, options, keep_logs, fault=fault).run()
    with tempfile.TemporaryDirectory(prefix="composer-chaos-") as logdir:
        return Chaos(db_url, options, Path(logdir), fault=fault).run()


def log_summary(logdir: Path) -> dict[str, Any]:
    """Counts from the processes' logs: stale results, lost leases, tracebacks by last line."""
    stale: Counter[str] = Counter()
    lease_lost = retried = 0
    tracebacks: Counter[str] = Counter()
    for log in sorted(logdir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "dropped stale result" in line:
                reason = line.split("): ", 1)[-1]
                stale[re.sub(r"[0-9a-f-]{36}|\d[\d:. T+-]*|\S+:\d+:[0-9a-f]{4}", "#", reason)[:100]] += 1
            elif "lease lost for task" in line:
                lease_lost += 1
            elif "transient database error" in line:
                retried += 1
            elif line.startswith("Traceback"):
                end = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith((" ", "Traceback"))),
                           None)
                last = lines[end] if end is not None else "?"
                tracebacks[re.sub(r"[0-9a-f-]{36}|\d+(\.\d+)?", "#", last)[:160]] += 1
    return {"stale": dict(stale), "lease_lost": lease_lost, "retried": retried, "tracebacks": dict(tracebacks)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.driver", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--coordinators", type=int, default=2)
    parser.add_argument("--rate", type=float, default=25.0, help="runs started per second")
    parser.add_argument("--no-restart", action="store_true", help="do not restart the server")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--logs", type=Path, help="keep the processes' logs in this directory")
    args = parser.parse_args(argv)
    options = Options(runs=args.runs, seed=args.seed, workers=args.workers, coordinators=args.coordinators,
                      start_rate=args.rate, restart=not args.no_restart, timeout_s=max(600.0, args.runs / 5))
    report = run_chaos(servers.session().primary, options, keep_logs=args.logs)
    print("\n".join(report.lines()), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**report.audit.figures, "kills": report.kills, "restarts": report.restarts,
                                         "elapsed_s": round(report.elapsed_s, 1), "ok": report.ok}, indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
