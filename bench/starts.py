"""Starts side by side from several connections: what a schema change costs or saves a start.

``python -m bench.starts [--pgbin DIR] [--threads 4] [--seconds 4] [--rounds 4] [--out FILE] NAME=DIR NAME=DIR``

For each source tree, a template database its own ``sql/`` migrated (:mod:`bench.sides`)
and a database cloned from it; then, the trees' order reversed every round,
``--threads`` threads of one :class:`~composer_ops.Engine` (this tree's code, for every
side: what differs is the schema) start runs of the 1-task workflow for ``--seconds``.
Per tree and round: starts a second, the server's CPU a start (the engine's sessions,
``/proc/PID/schedstat``), the client's, and the MultiXacts the server made (the
difference of ``next_multixact_id`` over a checkpoint before and after: concurrent row
locks on one row, such as a foreign key's on its parent, make them). Prints the medians
and the ratios of each tree's to the first's; writes them as JSON
(``bench/results/starts-pg<major>-<date>-<commit>.json`` unless ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from bench import scenario, sides
from bench.flowcost import OnCpu
from bench.report import dated_path
from bench.workload import ONE_TASK

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
APP = "bench-starts"


def _next_multixact(conn: psycopg.Connection[Any]) -> int:
    conn.execute("CHECKPOINT")
    row = conn.execute("SELECT next_multixact_id FROM pg_control_checkpoint()").fetchone()
    assert row is not None
    return int(row[0])


def _server_seconds(conn: psycopg.Connection[Any]) -> float:
    pids = [r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (APP,))]
    return sum(OnCpu(pid).seconds() for pid in pids)


def measure(url: str, *, threads: int, seconds: float) -> dict[str, float]:
    """``threads`` threads starting runs of the 1-task workflow on ``url`` for ``seconds``."""
    from composer_ops import Engine

    with Engine.connect(url, pool_size=threads, application_name=APP) as engine, \
            psycopg.connect(url, autocommit=True) as admin:
        for _ in range(threads * 5):                    # definitions cached, statements prepared
            engine.start(ONE_TASK["id"])
        started = [0] * threads
        mx0, srv0, cpu0 = _next_multixact(admin), _server_seconds(admin), time.process_time()
        t0 = time.perf_counter()
        stop = t0 + seconds

        def loop(k: int) -> None:
            while time.perf_counter() < stop:
                engine.start(ONE_TASK["id"])
                started[k] += 1

        workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        srv1, cpu1 = _server_seconds(admin), time.process_time()
        mx1 = _next_multixact(admin)
    n = sum(started)
    return {"starts": n, "starts_per_s": n / elapsed, "server_cpu_ms": (srv1 - srv0) / n * 1e3,
            "client_cpu_ms": (cpu1 - cpu0) / n * 1e3, "multixacts": mx1 - mx0}


def run(server: Any, trees: dict[str, Path], *, threads: int, seconds: float, rounds: int) -> dict[str, Any]:
    """Each tree's schema, measured ``rounds`` times alternately on ``server``: medians,
    ratios to the first tree's and every round. Leaves no database behind."""
    made = {name: sides.make_template(server, root, f"bench_starts_tpl_{name}", [ONE_TASK])
            for name, root in trees.items()}
    per: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        for r in range(rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                db = f"bench_starts_{name}"
                url = server.create_database(db, template=made[name]["template"])
                try:
                    got = measure(url, threads=threads, seconds=seconds)
                finally:
                    server.drop_database(db)
                per[name].append(got)
                print(f"[starts] round {r + 1}/{rounds} {name}: {got['starts_per_s']:.0f} starts/s, server CPU "
                      f"{got['server_cpu_ms']:.3f} ms a start, client {got['client_cpu_ms']:.3f}, "
                      f"{got['multixacts']} MultiXacts", file=sys.stderr, flush=True)
    finally:
        for template in made.values():
            server.drop_database(template["template"])
    keys = ("starts_per_s", "server_cpu_ms", "client_cpu_ms", "multixacts")
    medians = {name: {k: statistics.median(o[k] for o in outs) for k in keys} for name, outs in per.items()}
    first = next(iter(trees))
    ratios = {name: {k: round(m[k] / medians[first][k], 3) if medians[first][k] else None for k in keys[:3]}
              for name, m in medians.items()}
    return {"templates": made, "threads": threads, "seconds": seconds, "rounds": rounds, "median": medians,
            "ratio_to_" + first: ratios, "per_round": per}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.starts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", metavar="NAME=DIR", help="source trees, the first the reference")
    parser.add_argument("--pgbin", type=Path, help="server binaries of a throwaway cluster (default: the embedded "
                                                       "server)")
    parser.add_argument("--threads", type=int, default=4, help="connections starting runs side by side (default 4)")
    parser.add_argument("--seconds", type=float, default=4.0, help="each measurement's length (default 4)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the trees' order reversed each (default 4)")
    parser.add_argument("--out", type=Path, help="default bench/results/starts-pg<major>-<date>-<commit>.json")
    args = parser.parse_args()
    if args.threads < 1 or args.seconds <= 0 or args.rounds < 1:
        parser.error("--threads and --rounds must be at least 1, --seconds above 0")
    bad = [t for t in args.trees if "=" not in t]
    if bad:
        parser.error(f"a tree is NAME=DIR, got {bad[0]!r}")
    trees = {n: Path(r).resolve() for n, r in (t.split("=", 1) for t in args.trees)}
    server = scenario.start_server(args.pgbin)
    out: dict[str, Any] = {"server_version": server.version,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "command": "python -m bench.starts " + " ".join(sys.argv[1:]),
                           "load_average_before": os.getloadavg(),
                           **run(server, trees, threads=args.threads, seconds=args.seconds, rounds=args.rounds)}
    out["load_average_after"] = os.getloadavg()
    path = args.out or dated_path(RESULTS, f"starts-pg{server.version_num // 10000}-")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    for name, m in out["median"].items():
        print(f"{name}: {m['starts_per_s']:.0f} starts/s, server CPU {m['server_cpu_ms']:.3f} ms a start, "
              f"client {m['client_cpu_ms']:.3f} ms, {m['multixacts']:.0f} MultiXacts; "
              f"ratios {out['ratio_to_' + next(iter(trees))][name]}")
    print(f"[starts] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
