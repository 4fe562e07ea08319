"""The floor: Composer's rows written with as little as a worker can do, side by side
with Composer and Procrastinate.

``python -m bench.floor [--pgbin DIR] [--rounds 4] [--runs 1000] [--duration 5] [--workers 1] [--systems ...]
[--out FILE]``

A measurement of the design space, not a second engine. The third system here writes a
1-task run's rows exactly as :mod:`bench.layers`' plain statements do (the run, its
task, the outbox row and the 'started' history row in one statement; a claim deleting
the outbox row, leasing the task and writing the 'claimed' history row in one; a
completion locking and reading the run, completing the task, writing the 'completed'
history row and finishing the run, pipelined into two round trips, the worker's next
claim in its transaction), on the engine's own schema, with as little Python as a worker
can have: four threads, each a connection of its own, a no-op handler, no pure core,
no heartbeats, no registration, no coordinator. Idle threads sleep on the shared
channel the starts notify (50 ms at most). What it leaves out is
:mod:`bench.layers`' list (decisions, flow control, retries, hand-offs) and every
fault path: it is an upper bound on a design's rate and a lower bound on its CPU on
this machine, not something that could ship.

Hybrids put each side of a run on its own (:data:`HYBRIDS`, which says how far they
do): Composer's starts with the floor's worker, and the floor's starts with Composer's
worker; either worker takes either's runs, as both write the same rows. A third is the
floor with the engine's claim function in its worker (``composer_claim`` without the
registration a worker's own claims write).

Each round measures each system's sustained rate at one worker process, or at W with
``--workers`` W (as ``make bench``'s W=4 round; a producer of 4 threads holding the
backlog to ``--max-backlog``; the CPU is the server's and every process's, the
producer's included) and, at one worker, its drain of ``--runs`` (the runs started
first; the CPU is the worker side's alone; not at W > 1, where the CPU's window would
open only once every worker process is up, after the first ones drained part), in
:mod:`bench.scenario`'s code; the first round takes the systems in their order, the
next backwards, and so on. The floor's workers count their claims (a completion's next
claim included) as Composer's do.
Prints the medians of each system's runs/s and CPU per run and the medians of the
per-round ratios to Procrastinate; ``--out`` writes them as JSON (by default
``floor-pg<major>-...``, ``floor-w<W>-pg<major>-...`` with ``--workers``), partial (with
``failed``) when a measurement fails, which exits 1.

``python -m bench.floor worker --url URL`` is the floor's worker process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from rich.table import Table

from bench import scenario
from bench.layers import Claimed, Plain
from bench.measure import COMPOSER_UNITS, median
from bench.procs import ROOT, ProcessGroup, connections, wait_until
from bench.producer import UNFINISHED
from bench.report import figure, measured_run, parser, publish, require_binaries, stderr_log
from bench.scenario import System
from bench.workload import COMPOSER, run_window, spawn_cluster

RESULTS = ROOT / "bench" / "results"
CONCURRENCY = 4
#: The longest an idle thread sleeps before it claims again without a notification.
IDLE_WAIT_S = 0.05
APP = "bench-floor"
MODES = ("sustained", "drain")


def work(url: str, concurrency: int, stop: threading.Event, *, engine_claim: bool = False) -> dict[str, int]:
    """The floor's worker: ``concurrency`` threads, each claiming, running a no-op and
    completing with the next claim in the completion's transaction, until ``stop``.
    ``engine_claim``: claiming by the engine's ``composer_claim`` without registering
    (:data:`bench.layers.ENGINE_CLAIM`) instead of the plain statement. Returns the claims
    made (a completion's next claim included), how many came back empty and the tasks
    they took. A thread that fails stops the others; its error is raised once all ended."""
    wake = threading.Event()
    counts = {"claims": 0, "empty": 0, "tasks": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def counted(got: Claimed | None) -> Claimed | None:
        with lock:
            counts["claims"] += 1
            counts["empty" if got is None else "tasks"] += 1
        return got

    def listen() -> None:
        with psycopg.connect(url, autocommit=True, application_name=f"{APP}-listen") as conn:
            conn.execute("LISTEN composer_tasks")
            while not stop.is_set():
                for _ in conn.notifies(timeout=0.5, stop_after=1):
                    wake.set()

    def slot() -> None:
        plain = Plain(url, application_name=APP, engine_claim=engine_claim)
        held: Claimed | None = None
        try:
            while not stop.is_set():
                if held is None:
                    held = counted(plain.claim(APP))
                    if held is None:
                        wake.wait(IDLE_WAIT_S)
                        wake.clear()
                    continue
                held = counted(plain.complete(held, owner=APP, then_claim=True))
        finally:
            plain.close()

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                errors.append(exc)
                stop.set()
        return run

    threads = [threading.Thread(target=guarded(listen), daemon=True)]
    threads += [threading.Thread(target=guarded(slot), daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(timeout=5)
    if errors:
        raise errors[0]
    return counts


def spawn_workers(url: str, workers: int, root: Path = ROOT, *, engine_claim: bool = False) -> ProcessGroup:
    group = ProcessGroup(f"floor x{workers}", root)
    env = group.count_claims()
    for _ in range(workers):
        group.spawn(["-m", "bench.floor", "worker", "--url", url, *(["--engine-claim"] if engine_claim else [])],
                    env=env)
    wait_until(lambda: connections(url, APP) >= workers * CONCURRENCY and connections(url, f"{APP}-listen") >= workers,
               timeout=60, what=f"{workers} floor workers", group=group)
    return group


FLOOR = System(name="floor", concurrency=CONCURRENCY, units_sql=COMPOSER_UNITS, spawn=spawn_workers,
               unfinished_sql=UNFINISHED["floor"], runs_window=run_window)
#: Each side of a run on its own: Composer's starts with the floor's worker, and the
#: floor's starts with Composer's worker (and coordinator). Both write the same rows, so
#: either worker takes either's runs; the difference to the floor is about one side's
#: cost, not exactly: the floor's start notifies every worker on the shared channel at
#: each start and hands no wake-up (Composer's worker then claims as one told), and the
#: floor's worker registers nowhere (Composer's start then hands no wake-up out). And the
#: floor with the engine's claim function (without the registration a worker's claims
#: write) in its worker: about the claim's share.
HYBRIDS = {
    "floor-engine-claim": dataclasses.replace(FLOOR, spawn=functools.partial(spawn_workers, engine_claim=True),
                                              label="floor-engine-claim"),
    "composer-start-floor-worker": dataclasses.replace(COMPOSER, spawn=spawn_workers,
                                                       label="composer-start-floor-worker"),
    "floor-start-composer-worker": dataclasses.replace(FLOOR, spawn=spawn_cluster,
                                                       label="floor-start-composer-worker"),
}
SYSTEMS = ("composer", "floor", *HYBRIDS, "procrastinate")


def submitter(url: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    """The producer's call for the floor: a start as one statement, on a connection of
    each producer thread's own (:class:`bench.layers.Plain`)."""
    local = threading.local()
    made: list[Plain] = []
    lock = threading.Lock()

    def submit() -> None:
        plain = getattr(local, "plain", None)
        if plain is None:
            plain = local.plain = Plain(url, application_name="bench-producer")
            with lock:
                made.append(plain)
        plain.start()

    def close() -> None:
        for plain in made:
            plain.close()

    return submit, close


def measure(server: Any, *, rounds: int, runs: int, duration: float, max_backlog: int, peer: Any,
            systems: tuple[str, ...] = SYSTEMS, workers: int = 1,
            log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """``rounds`` rounds of each of ``systems``' (:data:`SYSTEMS`, Procrastinate among
    them) sustained rate at ``workers`` worker processes (each of :data:`CONCURRENCY`
    slots, as every system's) and, at one, its drain: the raw results, each system's medians, and
    the per-round ratios to Procrastinate. A measurement that fails ends the rounds:
    what was measured is returned, with ``failed`` saying why (None otherwise)."""
    from bench.workload import make_template

    if "procrastinate" not in systems:
        raise ValueError("the ratios are to Procrastinate: it must be one of the systems")
    by_name = {"composer": COMPOSER, "floor": FLOOR, **HYBRIDS, "procrastinate": peer.PROCRASTINATE}
    composer_tpl, peer_tpl = "bench_tpl_floor_composer", "bench_tpl_floor_peer"
    make_template(server, composer_tpl)
    peer.make_template(server, peer_tpl)
    chosen = [by_name[name] for name in systems]
    rows: list[dict[str, Any]] = []
    failed: str | None = None
    try:
        for r in range(rounds):
            # Forward, then backward: over two rounds each system runs as early as late.
            for system in chosen if r % 2 == 0 else chosen[::-1]:
                tpl = peer_tpl if system.name == "procrastinate" else composer_tpl
                sus = scenario.sustained(system, server, tpl, workers=workers, duration=duration,
                                         max_backlog=max_backlog)
                rows.append({**sus, "round": r})
                said = f"round {r + 1} of {rounds}: {system.tag} sustained {sus['runs_per_s']:.0f} runs/s"
                if workers == 1:
                    # At W > 1 a drain's CPU window opens once every worker process is
                    # up, and the first ones have drained part of it by then.
                    drained = scenario.drain(system, server, tpl, workers=workers, items=runs)
                    rows.append({**drained, "round": r})
                    said += f", drain {drained['runs_per_s']:.0f}"
                log(said)
    except Exception as exc:   # what was measured is kept, and the run is marked failed
        failed = f"{type(exc).__name__}: {exc}"
        log(f"stopped: {failed}")
    finally:
        for name in (composer_tpl, peer_tpl):
            server.drop_database(name)
    return {**summarize(rows, rounds), "workers": workers, "failed": failed}


def _cpu(row: dict[str, Any]) -> float | None:
    cpu = row["cpu"]
    if cpu["server_ms_per_item"] is None or cpu["processes_ms_per_item"] is None:
        return None
    total: float = cpu["server_ms_per_item"] + cpu["processes_ms_per_item"]
    return total


def summarize(rows: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Per mode and system: the median runs/s and CPU ms per run; per mode and system
    but Procrastinate: the per-round ratios of runs/s and of CPU to Procrastinate's,
    and their medians."""
    out: dict[str, Any] = {"rounds": rounds, "results": rows, "median": {}, "ratios": {}}
    names = sorted({row["system"] for row in rows})
    for mode in MODES:
        mine = [row for row in rows if row["mode"] == mode]
        if not mine:
            continue
        out["median"][mode] = {}
        for name in names:
            own = [row for row in mine if row["system"] == name]
            out["median"][mode][name] = {
                "runs_per_s": median(row["runs_per_s"] for row in own),
                "cpu_ms_per_run": median(_cpu(row) for row in own),
                "server_ms_per_run": median(row["cpu"]["server_ms_per_item"] for row in own),
                "processes_ms_per_run": median(row["cpu"]["processes_ms_per_item"] for row in own)}
        out["ratios"][mode] = {}
        for name in names:
            if name == "procrastinate":
                continue
            rate_r, cpu_r = [], []
            for r in range(rounds):
                a = [row for row in mine if row["system"] == name and row["round"] == r]
                p = [row for row in mine if row["system"] == "procrastinate" and row["round"] == r]
                if not a or not p:
                    continue
                if p[0]["runs_per_s"]:
                    rate_r.append(a[0]["runs_per_s"] / p[0]["runs_per_s"])
                ca, cp = _cpu(a[0]), _cpu(p[0])
                if ca is not None and cp:
                    cpu_r.append(ca / cp)
            out["ratios"][mode][name] = {"runs_per_s_rounds": rate_r, "runs_per_s": median(rate_r),
                                         "cpu_rounds": cpu_r, "cpu": median(cpu_r)}
    return out


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"W={result.get('workers', 1)}, medians of {result['rounds']} rounds "
                    f"(PostgreSQL {result.get('server_version', '?')}); "
                    "ratios to Procrastinate, median of the rounds' ratios")
    for col in ("mode", "system", "runs/s", "CPU ms/run", "server", "processes", "runs/s ratio", "CPU ratio"):
        t.add_column(col, justify="left" if col in ("mode", "system") else "right")
    for mode in result["median"]:
        for name, med in result["median"][mode].items():
            ratio = result["ratios"][mode].get(name) or {}
            t.add_row(mode, name, figure(med["runs_per_s"], 0), figure(med["cpu_ms_per_run"], 3),
                      figure(med["server_ms_per_run"], 3), figure(med["processes_ms_per_run"], 3),
                      figure(ratio.get("runs_per_s"), 2), figure(ratio.get("cpu"), 2))
    return t


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor worker")
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, default=CONCURRENCY)
    p.add_argument("--engine-claim", action="store_true",
                   help="claim by the engine's composer_claim (without registering)")
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    counts = work(args.url, args.concurrency, stop, engine_claim=args.engine_claim)   # a failure: its traceback, exit 1
    if os.environ.get("BENCH_CLAIM_LOG"):
        with open(os.environ["BENCH_CLAIM_LOG"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **counts, "by_reason": None}) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return _worker_main(argv[1:])
    p = parser("python -m bench.floor", __doc__, "floor-pg<major>-")
    p.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    p.add_argument("--runs", type=int, default=1000, help="runs (jobs) per drain (default 1000, as make bench)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per sustained workload (default 5)")
    p.add_argument("--max-backlog", type=int, default=50, help="unfinished runs the sustained producer allows")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes of each system, 4 slots each (default 1; make bench's W=4 round: 4)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"the systems measured, procrastinate among them (default {','.join(SYSTEMS)})")
    args = p.parse_args(argv)
    if (args.rounds < 1 or args.runs < 1 or not 0 < args.duration < math.inf or args.max_backlog < 1
            or args.workers < 1):
        p.error("--rounds, --runs, --max-backlog and --workers must be at least 1, --duration more than 0 seconds")
    systems = tuple(dict.fromkeys(x.strip() for x in args.systems.split(",") if x.strip()))
    if "procrastinate" not in systems or set(systems) - set(SYSTEMS):
        p.error(f"--systems takes procrastinate and any of {', '.join(x for x in SYSTEMS if x != 'procrastinate')}, "
                f"got {args.systems}")
    require_binaries(p, args.pgbin)
    from bench import peer_procrastinate as peer

    if not peer.installed():
        print("python -m bench.floor: Procrastinate is not installed (make bench installs it; "
              "or pip install 'procrastinate>=3,<4')", file=sys.stderr)
        return 2
    server = scenario.start_server(args.pgbin)
    log = stderr_log("floor")
    out = measured_run(server.version, "python -m bench.floor " + " ".join(argv),
                       lambda: measure(server, rounds=args.rounds, runs=args.runs, duration=args.duration,
                                       max_backlog=args.max_backlog, peer=peer, systems=systems,
                                       workers=args.workers, log=log))
    out["procrastinate_version"] = peer.version()
    kind = "floor-" if args.workers == 1 else f"floor-w{args.workers}-"
    publish(out, args.out, RESULTS, f"{kind}pg{server.version_num // 10000}-", table(out), log)
    if out["failed"]:
        print(f"python -m bench.floor: a measurement failed, the results are partial: {out['failed']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
