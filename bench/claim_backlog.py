"""One-task claims behind a backlog: does a claim's cost grow with the ready rows of its queue?

``python -m bench.claim_backlog [--pgbin DIR] [--sizes 50 2000 20000] [--claims 40] [--queues 1] [NAME=DIR ...]``

For each source tree (default: this one, as ``new``), a template database migrated by
that tree's own ``sql/`` (:mod:`bench.sides`), and for each backlog size a database
cloned from it holding ``--claims`` ready 1-task runs and, behind them in the claim's
order, that many more ready outbox rows of the same queue (rows of no task: a claim
never reaches them, it only has them to pass over or to read). Then ``--claims``
one-task claims, each listing that queue and ``--queues`` - 1 empty ones, from one
session, each ``composer_claim`` in a transaction of its own, measured around the
call: wall time, the server backend's time on a CPU (``/proc/PID/schedstat``) and the
outbox rows the transaction read (``pg_stat_xact_user_tables``: index fetches plus
sequential reads). The first five claims of a session are not counted (PL/pgSQL's
plans are custom until then).

Prints, per tree and size, the medians and the ratio of each to the smallest size's,
measured in this one run; ``--out`` writes them as JSON. The trees share one server
and run alternately, size by size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench import scenario, sides
from bench.flowcost import OnCpu
from bench.report import dated_path
from bench.workload import ONE_TASK
from composer_ops.testing.servers import Server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
WARM = 5


def _read(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT COALESCE(idx_tup_fetch, 0) + COALESCE(seq_tup_read, 0) FROM pg_stat_xact_user_tables"
                       " WHERE relname = 'task_outbox'").fetchone()
    return int(row[0]) if row else 0


def measure(url: str, *, backlog: int, claims: int, queues: int = 1) -> dict[str, float]:
    """``claims`` one-task claims of ``url`` behind ``backlog`` ready rows, each listing
    ``queues`` queues (``default`` and empty ones): medians."""
    listed = ["default"] + [f"empty-{i}" for i in range(1, queues)]
    from composer_ops import Engine

    with Engine.connect(url, pool_size=1, application_name="bench-backlog-setup") as engine:
        for _ in range(claims + WARM):
            engine.start(ONE_TASK["id"])
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("""INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at)
                        SELECT 'default', 'backlog-' || i, 'work', 1, 'noop', 30, now()
                          FROM generate_series(1, %s) AS i""", (backlog,))
        conn.execute("ANALYZE task_outbox")
        backend = OnCpu(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        wall: list[float] = []
        cpu: list[float] = []
        rows: list[int] = []
        for i in range(claims + WARM):
            with conn.transaction():
                read0, cpu0, t0 = _read(conn), backend.seconds(), time.perf_counter()
                got = conn.execute("SELECT run_id FROM composer_claim(%s, ARRAY['noop'], 'bench', 1, %s, NULL)",
                                   (listed, f"backlog-claim-{i}")).fetchall()
                t1, cpu1, read1 = time.perf_counter(), backend.seconds(), _read(conn)
            if len(got) != 1 or str(got[0][0]).startswith("backlog-"):
                raise RuntimeError(f"claim {i} behind {backlog} rows took {got}, not one run")
            if i >= WARM:
                wall.append((t1 - t0) * 1e3)
                cpu.append((cpu1 - cpu0) * 1e3)
                rows.append(read1 - read0)
    return {"claim_ms": statistics.median(wall), "server_cpu_ms": statistics.median(cpu),
            "outbox_rows_read": statistics.median(rows)}


def run(server: Server, trees: dict[str, Path], *, sizes: list[int], claims: int, queues: int = 1) -> dict[str, Any]:
    """Each tree's claims behind each size, on ``server``: the templates made and, per
    tree and size, the medians and their ratios to the smallest size's. Leaves no
    database behind."""
    made = {name: sides.make_template(server, root, f"bench_backlog_tpl_{name}", [ONE_TASK])
            for name, root in trees.items()}
    results: dict[str, dict[str, Any]] = {n: {} for n in trees}
    try:
        for size in sizes:
            for name in trees:
                db = f"bench_backlog_{name}_{size}"
                url = server.create_database(db, template=made[name]["template"])
                try:
                    got = measure(url, backlog=size, claims=claims, queues=queues)
                finally:
                    server.drop_database(db)
                results[name][str(size)] = got
                print(f"[claim_backlog] {name} behind {size}: claim {got['claim_ms']:.2f} ms, server CPU "
                      f"{got['server_cpu_ms']:.2f} ms, outbox rows read {got['outbox_rows_read']:.0f}", flush=True)
    finally:
        for template in made.values():
            server.drop_database(template["template"])
    smallest = str(min(sizes))
    for name, by_size in results.items():
        for key, medians in by_size.items():
            medians["ratio_to_smallest"] = {k: round(medians[k] / by_size[smallest][k], 2) if by_size[smallest][k]
                                            else None for k in ("claim_ms", "server_cpu_ms")}
            print(f"{name} behind {key} / behind {smallest}: claim x{medians['ratio_to_smallest']['claim_ms']}, "
                  f"server CPU x{medians['ratio_to_smallest']['server_cpu_ms']}")
    return {"templates": made, "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.claim_backlog", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", metavar="NAME=DIR", help="source trees (default: new=this one)")
    parser.add_argument("--pgbin", type=Path, help="server binaries of a throwaway cluster (default: the embedded "
                                                       "server)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 2000, 20000],
                        help="ready rows behind the claimed runs (default 50 2000 20000)")
    parser.add_argument("--claims", type=int, default=40, help="claims measured per tree and size (default 40)")
    parser.add_argument("--queues", type=int, default=1,
                        help="queues each claim lists: the workload's and empty ones (default 1)")
    parser.add_argument("--out", type=Path, help="default bench/results/claim-backlog-pg<major>-<date>-<commit>.json")
    args = parser.parse_args()
    if args.claims < 1 or args.queues < 1 or min(args.sizes) < 0:
        parser.error("--claims and --queues must be at least 1, --sizes at least 0")
    trees = {n: Path(r).resolve() for n, r in (t.split("=", 1) for t in args.trees)} if args.trees else {"new": ROOT}
    server = scenario.start_server(args.pgbin)
    out: dict[str, Any] = {"server_version": server.version,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "command": "python -m bench.claim_backlog " + " ".join(sys.argv[1:]),
                           "load_average_before": os.getloadavg(), "claims": args.claims, "queues": args.queues,
                           **run(server, trees, sizes=args.sizes, claims=args.claims, queues=args.queues)}
    out["load_average_after"] = os.getloadavg()
    path = args.out or dated_path(RESULTS, f"claim-backlog-pg{server.version_num // 10000}-")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"[claim_backlog] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
