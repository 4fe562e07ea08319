"""Round trips, statements and client CPU per event on the hot path, single-threaded.

One Engine with a single pooled connection, traced with libpq's PQtrace: a round
trip is a ReadyForQuery message from the server (one per synchronous exchange), a
statement an Execute or simple Query. Measured for the three events of a 1-task run:
start (Engine.start), claim (Engine.claim, one task per call as a busy worker mostly
claims) and complete (Engine.complete), and for a failure report (Engine.fail) of a
1-task workflow with two attempts: requeue (the first attempt failed, re-queued without
backoff) and fail (the last attempt failed, and the run with it); with the client's and
the server's CPU time per event. No concurrency: this isolates what the code asks of the server from how
busy the machine is.

``python -m bench.roundtrips [--runs N]`` prints a JSON object;
``python -m bench.roundtrips NAME=DIR NAME=DIR ... [--rounds N]`` runs it from each source
tree (each on its own schema), alternated, and prints the medians and every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psycopg.pq import Trace

from bench.cpu import ServerCPU, per_item_ms
from composer_ops.testing.servers import Server


def _count(path: str) -> tuple[int, int, int]:
    ready = statements = parses = 0
    with open(path, errors="replace") as f:
        for line in f:
            parts = line.split("\t")
            if len(parts) < 3:
                continue
            if parts[0] == "B" and parts[2].startswith("ReadyForQuery"):
                ready += 1
            elif parts[0] == "F" and parts[2].strip() in ("Execute", "Query"):
                statements += 1
            elif parts[0] == "F" and parts[2].strip() == "Parse":
                parses += 1
    return ready, statements, parses


#: A 1-task workflow whose task fails twice: re-queued at once, then failed for good.
FLAKY: dict[str, Any] = {"id": "bench-flaky", "nodes": [{
    "id": "a", "type": "TASK", "task": "flaky",
    "retry": {"max_attempts": 2, "initial_backoff_s": 0, "multiplier": 1, "max_backoff_s": 0}}]}


def measure(server: Server, template: str, *, runs: int = 500) -> dict[str, Any]:
    from composer_ops import Engine

    db = "bench_roundtrips"
    url = server.create_database(db, template=template)
    try:
        server_cpu = ServerCPU(url)
        with Engine.connect(url, pool_size=1, application_name="bench-roundtrips") as engine:
            # warm up: definitions cached, statements prepared (psycopg prepares after 5 uses)
            for _ in range(10):
                engine.start("bench-one")
            for c in engine.claim(["default"], "rt", 10, task_names=["noop"]):
                engine.complete(c, None)
            out: dict[str, Any] = {"runs": runs}
            claims: list[Any] = []

            def start() -> None:
                for _ in range(runs):
                    engine.start("bench-one")

            def claim() -> None:
                for _ in range(runs):
                    claims.extend(engine.claim(["default"], "rt", 1, task_names=["noop"]))

            def complete() -> None:
                for c in claims:
                    engine.complete(c, None)

            engine.deploy(FLAKY)
            failing: list[Any] = []

            def claim_failing() -> None:
                failing.clear()
                while len(failing) < runs:
                    got = engine.claim(["default"], "rt", 50, task_names=["flaky"])
                    if not got:
                        time.sleep(0.01)
                    failing.extend(got)

            def fail() -> None:
                for c in failing:
                    if engine.fail(c, "boom").stale:
                        raise RuntimeError(f"failure of {c.task_id} was stale")

            def prepare_failures() -> None:
                for _ in range(runs):
                    engine.start(FLAKY["id"])
                claim_failing()

            ops: list[tuple[str, Callable[[], None]]] = [
                ("start", start), ("claim", claim), ("complete", complete),
                ("requeue", fail), ("fail", fail)]
            before: dict[str, Callable[[], None]] = {"requeue": prepare_failures, "fail": claim_failing}
            for name, op in ops:
                if name in before:
                    before[name]()
                fd, path = tempfile.mkstemp(prefix="composer-trace-")
                try:
                    with engine.pool.connection() as conn:
                        conn.pgconn.trace(fd)
                        conn.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS)
                    srv0 = server_cpu.seconds()
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    op()
                    cpu1, wall1 = time.process_time(), time.perf_counter()
                    srv1 = server_cpu.seconds()
                    with engine.pool.connection() as conn:
                        conn.pgconn.untrace()
                    ready, statements, parses = _count(path)
                finally:
                    os.close(fd)
                    os.unlink(path)
                out[name] = {"round_trips": ready / runs, "statements": statements / runs,
                             "parses": parses / runs,
                             "client_cpu_ms": (cpu1 - cpu0) / runs * 1000,
                             "server_cpu_ms": per_item_ms(None if srv0 is None or srv1 is None else srv1 - srv0, runs),
                             "wall_ms": (wall1 - wall0) / runs * 1000}
            if len(claims) != runs:
                raise RuntimeError(f"claimed {len(claims)} of {runs} tasks")
        return out
    finally:
        server.drop_database(db)


def alternate(trees: dict[str, Path], rounds: int, runs: int) -> dict[str, Any]:
    """This measurement run from each source tree (``name -> tree``, each on a schema its
    own ``sql/`` migrated, :mod:`bench.sides`), the trees' order reversed every round;
    the medians per tree and event, and every round."""
    from bench import sides

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    per: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    loads: list[float] = []
    for r in range(rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            per[name].append(json.loads(sides.run(trees[name], "-m", "bench.roundtrips", "--runs", str(runs))))
            loads.append(os.getloadavg()[0])
    medians = {name: {event: {key: statistics.median(o[event][key] for o in outs if o[event][key] is not None)
                              for key in ("round_trips", "statements", "client_cpu_ms", "server_cpu_ms", "wall_ms")}
                      for event, first in outs[0].items() if isinstance(first, dict)}
               for name, outs in per.items()}
    return {"trees": {name: str(root) for name, root in trees.items()}, "runs": runs, "rounds": rounds,
            "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "load_1min_after_each": loads}, "median": medians, "per_round": per}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.roundtrips")
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("trees", nargs="*", metavar="NAME=DIR",
                        help="run from each source tree instead, alternated (--rounds), and print the medians")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if args.trees:
        trees = {name: Path(root).resolve() for name, root in (t.split("=", 1) for t in args.trees)}
        print(json.dumps(alternate(trees, args.rounds, args.runs), indent=1))
        return
    from bench.workload import make_template
    from composer_ops.testing import servers

    server = servers.session().primary
    print(json.dumps(measure(server, make_template(server, "bench_tpl_rt"), runs=args.runs), indent=2))


if __name__ == "__main__":
    main()
