"""Starts side by side from several connections: what a schema change costs or saves a start.

``python -m bench.starts [--pgbin DIR] [--threads 4] [--seconds 4] [--rounds 4] [--out FILE] NAME=DIR NAME=DIR``

For each source tree, a template database its own ``sql/`` migrated (:mod:`bench.sides`)
and a database cloned from it; then, the trees' order reversed every round,
``--threads`` threads of one :class:`~composer_ops.Engine` (this tree's code, for every
side: what differs is the schema) start runs of the 1-task workflow for ``--seconds``.
Per tree and round: starts a second, the server's CPU a start (the engine's sessions,
``/proc/PID/schedstat``), the client's, and the MultiXacts the server made (the
difference of ``next_multixact_id`` over a checkpoint before and after: concurrent row
locks on one row, such as a foreign key's on its parent, make them; ``CHECKPOINT`` needs
a superuser or ``pg_checkpoint``). The server's CPU is read only where the server runs
here (not one of ``COMPOSER_DATABASE_URL``, which this tool uses when set): None
otherwise. Prints the medians and the ratios of each tree's to the first's; writes them
as JSON (``bench/results/starts-pg<major>-<date>-<commit>.json`` unless ``--out``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench import report, scenario, sides
from bench.flowcost import OnCpu
from bench.producer import produce
from bench.workload import ONE_TASK

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
APP = "bench-starts"


def _next_multixact(conn: psycopg.Connection[Any]) -> int:
    conn.execute("CHECKPOINT")
    row = conn.execute("SELECT next_multixact_id FROM pg_control_checkpoint()").fetchone()
    assert row is not None
    return int(row[0])


def _backends(conn: psycopg.Connection[Any]) -> list[OnCpu]:
    return [OnCpu(r[0]) for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                                              "AND datname = current_database()", (APP,))]


def _started(produced: dict[str, Any]) -> int:
    """How many runs :func:`bench.producer.produce` started; a failed start raises."""
    if produced["errors"]:
        raise RuntimeError(f"bench.starts: {produced['errors']} starts failed, the first: {produced['first_error']}")
    return int(produced["submitted"])


def measure(url: str, *, threads: int, seconds: float | None = None, starts: int | None = None,
            server_local: bool = True) -> dict[str, Any]:
    """``threads`` threads starting runs of the 1-task workflow on ``url`` for ``seconds``,
    or (``starts``) until that many runs are started, however long it takes: what a test
    on a loaded machine waits for."""
    if (seconds is None) == (starts is None):
        raise ValueError("give seconds or starts")
    from composer_ops import Engine

    with Engine.connect(url, pool_size=threads, application_name=APP) as engine, \
            psycopg.connect(url, autocommit=True) as admin:
        def start() -> None:
            engine.start(ONE_TASK["id"])

        engine.pool.resize(threads, threads)     # every connection open before the window
        engine.pool.wait(60)
        _started(produce(start, threads=threads, count=5 * threads))   # the definition cached, statements prepared
        backends = _backends(admin)
        if len(backends) != threads:
            raise RuntimeError(f"bench.starts: {len(backends)} engine sessions open, not {threads}")
        readable = server_local and all(b.readable for b in backends)
        mx0 = _next_multixact(admin)
        srv0 = sum(b.seconds() for b in backends) if readable else 0.0
        cpu0, t0 = time.process_time(), time.perf_counter()
        n = _started(produce(start, threads=threads, seconds=seconds, count=starts))
        elapsed = time.perf_counter() - t0
        srv1 = sum(b.seconds() for b in backends) if readable else 0.0
        cpu1 = time.process_time()
        mx1 = _next_multixact(admin)
    if n == 0:
        raise RuntimeError(f"bench.starts: no run started in {seconds} s")   # only a window can end with none
    return {"starts": n, "starts_per_s": n / elapsed, "server_cpu_ms": (srv1 - srv0) / n * 1e3 if readable else None,
            "client_cpu_ms": (cpu1 - cpu0) / n * 1e3, "multixacts": mx1 - mx0}


def _median(values: list[Any]) -> float | None:
    return None if any(v is None for v in values) else float(statistics.median(values))


def _ms(value: float | None) -> str:
    return "not read" if value is None else f"{value:.3f} ms"


def run(server: Any, trees: dict[str, Path], *, threads: int, rounds: int, seconds: float | None = None,
        starts: int | None = None) -> dict[str, Any]:
    """Each tree's schema, measured ``rounds`` times alternately on ``server``: medians,
    ratios to the first tree's and every round. Leaves no database behind."""
    made: dict[str, dict[str, Any]] = {}
    per: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    local = server.owned
    try:
        for name, root in trees.items():
            made[name] = sides.make_template(server, root, f"bench_starts_tpl_{name}", [ONE_TASK])
        for r in range(rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                with server.database(template=made[name]["template"], prefix=f"bench_starts_{name}_") as url:
                    got = measure(url, threads=threads, seconds=seconds, starts=starts, server_local=local)
                per[name].append(got)
                print(f"[starts] round {r + 1}/{rounds} {name}: {got['starts_per_s']:.0f} starts/s, server CPU "
                      f"{_ms(got['server_cpu_ms'])} a start, client {_ms(got['client_cpu_ms'])}, "
                      f"{got['multixacts']} MultiXacts", file=sys.stderr, flush=True)
    finally:
        for name in trees:                       # made or not (a failed migrate leaves its database)
            server.drop_database(f"bench_starts_tpl_{name}")
    keys = ("starts_per_s", "server_cpu_ms", "client_cpu_ms", "multixacts")
    medians = {name: {k: _median([o[k] for o in outs]) for k in keys} for name, outs in per.items()}
    first = next(iter(trees))
    ratios = {name: {k: round(v / base, 3) if v is not None and (base := medians[first][k]) else None
                     for k, v in m.items() if k != "multixacts"}
              for name, m in medians.items()}
    return {"templates": made, "threads": threads, "seconds": seconds, "starts": starts, "rounds": rounds,
            "median": medians, "ratio_to_" + first: ratios, "per_round": per}


def main() -> int:
    parser = report.parser("python -m bench.starts", __doc__, "starts-pg<major>-")
    parser.add_argument("trees", nargs="+", metavar="NAME=DIR", help="source trees, the first the reference")
    parser.add_argument("--threads", type=int, default=4, help="connections starting runs side by side (default 4)")
    parser.add_argument("--seconds", type=float, default=4.0, help="each measurement's length (default 4)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the trees' order reversed each (default 4)")
    args = parser.parse_args()
    report.require_binaries(parser, args.pgbin)
    if args.threads < 1 or args.seconds <= 0 or args.rounds < 1:
        parser.error("--threads and --rounds must be at least 1, --seconds above 0")
    bad = [t for t in args.trees if "=" not in t]
    if bad:
        parser.error(f"a tree is NAME=DIR, got {bad[0]!r}")
    names = [t.split("=", 1)[0] for t in args.trees]
    if len(set(names)) != len(names):
        parser.error(f"each tree needs a name of its own, got {', '.join(names)}")
    trees = {n: Path(r).resolve() for n, r in (t.split("=", 1) for t in args.trees)}
    server = scenario.start_server(args.pgbin)
    out = report.measured_run(server.version, "python -m bench.starts " + " ".join(sys.argv[1:]),
                              lambda: run(server, trees, threads=args.threads, seconds=args.seconds,
                                          rounds=args.rounds))
    path = report.write_results(out, args.out, RESULTS, f"starts-pg{server.version_num // 10000}-")
    for name, m in out["median"].items():
        print(f"{name}: {m['starts_per_s']:.0f} starts/s, server CPU {_ms(m['server_cpu_ms'])} a start, "
              f"client {_ms(m['client_cpu_ms'])}, {m['multixacts']:.0f} MultiXacts; "
              f"ratios {out['ratio_to_' + next(iter(trees))][name]}")
    print(f"[starts] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
