"""Two bodies of the Citus node claim, side by side on one cluster.

``python -m bench.citus_claim_ab [--rounds 4] [--claims 150] A=PATH B=PATH ...`` starts a
coordinator and two worker nodes (:mod:`bench.citus_profile`'s settings), migrates a
database, and in each round, for each body in turn (the order reversed every other
round), installs the file ``PATH`` (a version of ``sql/citus/R__claim_node.sql``),
starts ``--claims`` 1-task runs, makes one claim to compile the body, then measures
``--claims`` - 1 one-task claims from one client: the CPU time of every server process
of the worker nodes and of the coordinator (``/proc/PID/schedstat``, nanoseconds:
psutil's times count in 10 ms ticks), per task claimed. Then it completes the claims.
One cluster for every body: only the body differs between measurements. The database
keeps every round's runs, so later rounds run on more rows; compare bodies within a
run, not with :mod:`bench.citus_profile`'s figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg

from bench.citus_profile import PROFILE_SETTINGS, Probe
from bench.workload import ONE_TASK
from composer_ops.testing.citus import CitusCluster


def _on_cpu_ns(postmaster: psutil.Process) -> dict[int, int]:
    """Nanoseconds on a CPU so far, per child of ``postmaster``."""
    out: dict[int, int] = {}
    for child in postmaster.children():
        try:
            out[child.pid] = int(Path(f"/proc/{child.pid}/schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue    # exited meanwhile
    return out


def median_rounds(values: list[float]) -> str:
    """``median M ms (rounds a, b, ...)``: how the A/B scripts print a figure per round."""
    return f"median {statistics.median(values):.2f} ms (rounds {', '.join(f'{x:.2f}' for x in values)})"


def save(out: dict[str, Any], path: str | None) -> None:
    """Write a Citus script's result as JSON to ``path`` (None: nowhere), with the load
    average at its end."""
    out["load_average_end"] = psutil.getloadavg()
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def measure(bodies: dict[str, Path], *, rounds: int, claims: int) -> dict[str, list[dict[str, float]]]:
    from composer_ops import Engine
    from composer_ops.db.migrate import migrate

    results: dict[str, list[dict[str, float]]] = {name: [] for name in bodies}
    cluster = CitusCluster.start(workers=2, shard_count=32, settings=PROFILE_SETTINGS)
    try:
        url = cluster.create_database("claim_ab")
        migrate(url)
        probe = Probe(cluster, "claim_ab")
        engine = Engine.connect(url, pool_size=1, application_name="claim-ab-client")
        try:
            engine.deploy(ONE_TASK)
            order = list(bodies.items())
            for r in range(rounds):
                for name, path in order if r % 2 == 0 else order[::-1]:
                    with psycopg.connect(url, autocommit=True) as conn:
                        conn.execute(path.read_text())
                    for _ in range(claims):
                        engine.start(ONE_TASK["id"])
                    for c in engine.claim(["default"], "ab", 1):
                        engine.complete(c, None)
                    before = [_on_cpu_ns(p) for p in probe.postmasters]
                    t0 = time.monotonic()
                    got = [engine.claim(["default"], "ab", 1) for _ in range(claims - 1)]
                    wall = time.monotonic() - t0
                    after = [_on_cpu_ns(p) for p in probe.postmasters]
                    tasks = max(1, sum(len(g) for g in got))
                    ms = [sum(v - b.get(pid, 0) for pid, v in a.items()) / 1e6 / tasks
                          for b, a in zip(before, after, strict=True)]
                    results[name].append({"round": r, "tasks": tasks, "worker_nodes_cpu_ms_per_task": sum(ms[1:]),
                                          "coordinator_cpu_ms_per_task": ms[0], "wall_ms_per_task": 1000 * wall / tasks,
                                          "load_average": psutil.getloadavg()[0]})
                    print(name, results[name][-1], file=sys.stderr, flush=True)
                    for g in got:
                        for c in g:
                            engine.complete(c, None)
        finally:
            engine.close()
            probe.close()
    finally:
        cluster.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.citus_claim_ab")
    parser.add_argument("bodies", nargs="+", metavar="NAME=PATH", help="a version of R__claim_node.sql")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--claims", type=int, default=150)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    bodies = {name: Path(path) for name, path in (b.split("=", 1) for b in args.bodies)}
    results = measure(bodies, rounds=args.rounds, claims=args.claims)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "claims": args.claims,
                           "bodies": {k: str(v) for k, v in bodies.items()}, "rounds": results}
    for name, rows in results.items():
        nodes = [row["worker_nodes_cpu_ms_per_task"] for row in rows]
        coordinator = [row["coordinator_cpu_ms_per_task"] for row in rows]
        print(f"{name}: worker nodes' CPU per task claimed, {median_rounds(nodes)}; "
              f"coordinator {statistics.median(coordinator):.2f} ms")
    save(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
