"""Two bodies of the Citus node scan, side by side on one cluster.

``python -m bench.citus_scan_ab [--shards 8 32] [--rounds 3] [--passes 40] A=PATH B=PATH ...``
starts, for each shard count, a coordinator and two worker nodes
(:mod:`bench.citus_profile`'s settings, ``citus.shard_count`` = the count), migrates a
database, starts ``--runs`` 1-task runs (their dispatches are the start timeouts' rows)
and, in each round, for each body in turn (the order reversed every other round),
installs the file ``PATH`` (a version of ``sql/citus/R__scan_node.sql``), makes 5 passes
to compile it (and, for a body that caches plans, to fill its cache), then measures
``--passes`` passes of the coordinator's node scans, as ``Coordinator._node_scan`` makes
them: one ``composer_scan_node`` call per worker node, every kind, the coordinator's
floor and ceiling, from one autocommit connection kept open (so each node is reached
over the same cached connection, as the coordinator's are). Half the runs' tasks are
claimed and left RUNNING: a day ahead their leases have expired. Measured: the CPU time of
every server process of the worker nodes and of the coordinator (``/proc/PID/schedstat``),
per pass. Before measuring, each body's rows for a clock a day ahead (every dispatch
past its ``start_by``, every lease expired) are compared with the first body's: a body that finds other
rows fails the run. One cluster per shard count: only the body differs between
measurements.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import psycopg

from bench.citus_claim_ab import _on_cpu_ns, median_rounds, save
from bench.citus_profile import PROFILE_SETTINGS, Probe
from bench.workload import ONE_TASK
from composer_ops.testing.citus import CitusCluster

if TYPE_CHECKING:
    from composer_ops.engine.coordinator import Coordinator


@dataclass
class Seeded:
    """A cluster the pass's A/B scripts measure on (:func:`seeded`)."""

    url: str
    probe: Probe
    coordinator: Coordinator
    claimed: int


@contextmanager
def seeded(name: str, *, shards: int, runs: int) -> Iterator[Seeded]:
    """A coordinator and two worker nodes of ``shards`` shards, a database ``name``
    migrated, ``runs`` one-task runs started and half of them claimed (their leases held),
    a coordinator of its own; stopped at the end."""
    from composer_ops import Engine
    from composer_ops.db.migrate import migrate

    cluster = CitusCluster.start(workers=2, shard_count=shards, settings=PROFILE_SETTINGS)
    try:
        url = cluster.create_database(name)
        migrate(url)
        probe = Probe(cluster, name)
        engine = Engine.connect(url, pool_size=1, application_name=f"{name}-client")
        coordinator_engine = Engine.connect(url, pool_size=1, application_name=f"{name}-coordinator")
        try:
            engine.deploy(ONE_TASK)
            for _ in range(runs):
                engine.start(ONE_TASK["id"])
            claimed = sum(len(engine.claim(["default"], name, 1)) for _ in range(runs // 2))
            yield Seeded(url=url, probe=probe, coordinator=coordinator_engine.coordinator(), claimed=claimed)
        finally:
            engine.close()
            coordinator_engine.close()
            probe.close()
    finally:
        cluster.stop()


def timed(probe: Probe, one_pass: Callable[[], object], *, passes: int, r: int, rows: int) -> dict[str, float]:
    """``passes`` calls of ``one_pass``: the servers' CPU per call (the coordinator's, the
    worker nodes', all) and the wall time, as a round's row of the A/B scripts."""
    before = [_on_cpu_ns(p) for p in probe.postmasters]
    t0 = time.monotonic()
    for _ in range(passes):
        one_pass()
    wall = time.monotonic() - t0
    after = [_on_cpu_ns(p) for p in probe.postmasters]
    ms = [sum(v - b.get(pid, 0) for pid, v in a.items()) / 1e6 / passes for b, a in zip(before, after, strict=True)]
    return {"round": r, "rows_a_day_ahead": rows, "worker_nodes_cpu_ms_per_pass": sum(ms[1:]),
            "coordinator_cpu_ms_per_pass": ms[0], "all_nodes_cpu_ms_per_pass": sum(ms),
            "wall_ms_per_pass": 1000 * wall / passes, "load_average": psutil.getloadavg()[0]}


def measure(bodies: dict[str, Path], *, shards: int, rounds: int, passes: int, runs: int) -> dict[str, Any]:
    from composer_ops.repo import citus, citus_scan, clock

    results: dict[str, list[dict[str, float]]] = {name: [] for name in bodies}
    with seeded("scan_ab", shards=shards, runs=runs) as seed, \
            psycopg.connect(seed.url, autocommit=True, application_name="scan-ab-scans") as conn:
        keys = citus_scan.covered(conn, citus.stream_keys(conn)).keys

        def one_pass(ahead: timedelta = timedelta(0)) -> list[Any]:
            now = clock.now(conn) + ahead
            floor, ceiling = seed.coordinator.active_floor(conn), seed.coordinator.active_ceiling(conn, now)
            found: list[Any] = []
            for key in keys:
                found += citus_scan.scan_node(conn, key, now=now, floor=floor, ceiling=ceiling, limit=100,
                                              kinds=citus_scan.KINDS)
            return found

        reference: list[Any] | None = None
        order = list(bodies.items())
        for r in range(rounds):
            for name, path in order if r % 2 == 0 else order[::-1]:
                with psycopg.connect(seed.url, autocommit=True) as admin:
                    admin.execute(path.read_text())
                for _ in range(5):
                    one_pass()
                rows = sorted(repr(row) for row in one_pass(timedelta(days=1)))
                if reference is None:
                    reference = rows
                elif rows != reference:
                    raise SystemExit(f"{name} found other rows than the first body ({len(rows)} vs "
                                     f"{len(reference)})")
                results[name].append(timed(seed.probe, one_pass, passes=passes, r=r, rows=len(rows)))
                print(shards, name, results[name][-1], file=sys.stderr, flush=True)
    return {"shards": shards, "worker_nodes": len(keys), "claimed": seed.claimed, "rounds": results}


def pass_options(parser: argparse.ArgumentParser) -> None:
    """The options the pass's A/B scripts share: shard counts, rounds, passes, runs, JSON."""
    parser.add_argument("--shards", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--json", help="write the result here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.citus_scan_ab")
    parser.add_argument("bodies", nargs="+", metavar="NAME=PATH", help="a version of R__scan_node.sql")
    pass_options(parser)
    args = parser.parse_args(argv)
    bodies = {name: Path(path) for name, path in (b.split("=", 1) for b in args.bodies)}
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "passes": args.passes,
                           "runs": args.runs, "bodies": {k: str(v) for k, v in bodies.items()}, "clusters": []}
    for shards in args.shards:
        result = measure(bodies, shards=shards, rounds=args.rounds, passes=args.passes, runs=args.runs)
        out["clusters"].append(result)
        for name, rows in result["rounds"].items():
            nodes = [row["worker_nodes_cpu_ms_per_pass"] for row in rows]
            wall = [row["wall_ms_per_pass"] for row in rows]
            print(f"{shards} shards, {name}: worker nodes' CPU per pass, {median_rounds(nodes)}; "
                  f"wall median {statistics.median(wall):.1f} ms")
    save(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
