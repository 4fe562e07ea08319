"""The coordinator's reads of an idle pass on Citus, before and after the node scan read
the children loop's rows and the relay's due deliveries too, side by side on one cluster.

``python -m bench.citus_pass_ab [--shards 8 32] [--rounds 3] [--passes 40] --before PATH``
starts, for each shard count, a coordinator and two worker nodes
(:mod:`bench.citus_profile`'s settings, ``citus.shard_count`` = the count), migrates a
database (this tree's ``sql/citus/R__scan_node.sql``), then installs the file ``PATH``, a
version of that file with the node scan of three kinds and nine arguments, beside it
(the two functions differ in their arguments). It starts ``--runs`` 1-task runs, half
of them claimed and left RUNNING, and, in each round, for each side in turn (the order
reversed every other round), makes 5 passes, then measures ``--passes`` passes of the
reads the coordinator's pass makes on that side, from one autocommit connection per side
kept open (each side's node sessions keep their own prepared statements):

- ``before``: one call of the nine-argument ``composer_scan_node`` per worker node
  (timers, leases, starts), then the children loop's ``deliveries.pending`` and the
  relay's read of due deliveries in a transaction (``webhooks.due``), each over every
  shard through the coordinator;
- ``after``: one call of this tree's ``composer_scan_node`` per worker node, all five
  kinds, and nothing else (the relay given no candidate opens no transaction).

Both sides take the clock and the coordinator's floor and ceiling first. Nothing is due:
these are idle passes. Then, in each round, ``--passes`` calls of the priority aging's
read (``outbox.raise_waiting``, which both sides make every ``priority_aging_s / 4``, over
every shard through the coordinator; the runs have one priority, so it raises none) are
measured the same way, as ``aging``, and ``--passes`` calls of the lease sweeper's
check of the queue limits (``citus_flow.free_stale``, every pass on both sides, over
every shard; no queue has a limit, so it frees none), as ``heal``. Before measuring,
the sides' candidates a day ahead (every lease expired) are compared: a side that finds
other rows fails the run. Measured: the CPU time of every server process of the worker
nodes and of the coordinator (``/proc/PID/schedstat``), per pass (per call for
``aging`` and ``heal``), and the wall time per pass.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from bench.citus_claim_ab import median_rounds, save
from bench.citus_scan_ab import pass_options, seeded, timed

_BEFORE_SCAN = "SELECT kind, run_id, task_id FROM composer_scan_node(%s, %s, %s, %s, %s, %s, %s, %s, %s)"


def measure(before_body: Path, *, shards: int, rounds: int, passes: int, runs: int) -> dict[str, Any]:
    from composer_ops.repo import citus, citus_flow, citus_scan, clock, deliveries, outbox, webhooks

    results: dict[str, list[dict[str, float]]] = {"before": [], "after": [], "aging": [], "heal": []}
    with seeded("pass_ab", shards=shards, runs=runs) as seed:
        with psycopg.connect(seed.url, autocommit=True) as admin:
            admin.execute(before_body.read_text())
        coordinator = seed.coordinator
        with psycopg.connect(seed.url, autocommit=True, application_name="pass-ab-before") as before_conn, \
                psycopg.connect(seed.url, autocommit=True, application_name="pass-ab-after") as after_conn:
            keys = citus_scan.covered(after_conn, citus.stream_keys(after_conn)).keys

            def bounds(conn: psycopg.Connection[Any], ahead: timedelta) -> tuple[datetime, str, str | None]:
                now = clock.now(conn) + ahead
                return now, coordinator.active_floor(conn), coordinator.active_ceiling(conn, now)

            def before(ahead: timedelta = timedelta(0)) -> list[str]:
                conn = before_conn
                now, floor, ceiling = bounds(conn, ahead)
                found: list[str] = []
                for key in keys:
                    found += [repr(tuple(r)) for r in conn.execute(
                        _BEFORE_SCAN, (key, now, floor, ceiling, 100, list(citus_scan.KINDS), [], [], []),
                        prepare=False).fetchall()]
                found += [repr(("child", *k)) for k in deliveries.pending(conn, 100)]
                with conn.transaction():
                    found += [repr(("webhook", w.run_id, w.id)) for w in webhooks.due(conn, 20)]
                return found

            def after(ahead: timedelta = timedelta(0)) -> list[str]:
                conn = after_conn
                now, floor, ceiling = bounds(conn, ahead)
                found: list[str] = []
                for key in keys:
                    for _, c in citus_scan.scan_node(conn, key, now=now, floor=floor, ceiling=ceiling,
                                                     limit=100, kinds=citus_scan.ALL_KINDS):
                        found.append(repr(_row(c)))
                return found

            def aging(ahead: timedelta = timedelta(0)) -> list[str]:
                outbox.raise_waiting(after_conn, 60.0)
                return []

            def heal(ahead: timedelta = timedelta(0)) -> list[str]:
                citus_flow.free_stale(after_conn)
                return []

            sides: list[tuple[str, Callable[..., list[str]]]] = [("before", before), ("after", after)]
            for r in range(rounds):
                rows: dict[str, list[str]] = {}
                for name, one_pass in [*(sides if r % 2 == 0 else sides[::-1]), ("aging", aging), ("heal", heal)]:
                    for _ in range(5):
                        one_pass()
                    rows[name] = sorted(one_pass(timedelta(days=1)))
                    results[name].append(timed(seed.probe, one_pass, passes=passes, r=r, rows=len(rows[name])))
                    print(shards, name, results[name][-1], file=sys.stderr, flush=True)
                if rows["before"] != rows["after"]:
                    raise SystemExit(f"the sides found other rows a day ahead ({len(rows['before'])} vs "
                                     f"{len(rows['after'])})")
    return {"shards": shards, "worker_nodes": len(keys), "claimed": seed.claimed, "rounds": results}


def _row(candidate: Any) -> tuple[Any, ...]:
    """A candidate of this tree's node scan as the before side's row."""
    from composer_ops.repo.rows import DueWait, DueWebhook, ExpiredLease, PendingChild

    if isinstance(candidate, DueWait):
        return ("timer", candidate.run_id, candidate.task_id)
    if isinstance(candidate, ExpiredLease):
        return ("lease", candidate.run_id, candidate.task_id)
    if isinstance(candidate, PendingChild):
        return ("child", candidate.run_id, candidate.target_run_id)
    if isinstance(candidate, DueWebhook):
        return ("webhook", candidate.run_id, candidate.id)
    return ("start", candidate.run_id, candidate.task_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.citus_pass_ab")
    parser.add_argument("--before", required=True, help="a version of R__scan_node.sql of nine arguments")
    pass_options(parser)
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "passes": args.passes,
                           "runs": args.runs, "before": args.before, "clusters": []}
    for shards in args.shards:
        result = measure(Path(args.before), shards=shards, rounds=args.rounds, passes=args.passes, runs=args.runs)
        out["clusters"].append(result)
        for name, rows in result["rounds"].items():
            total = [row["all_nodes_cpu_ms_per_pass"] for row in rows]
            nodes = [row["worker_nodes_cpu_ms_per_pass"] for row in rows]
            coord = [row["coordinator_cpu_ms_per_pass"] for row in rows]
            wall = [row["wall_ms_per_pass"] for row in rows]
            print(f"{shards} shards, {name}: all nodes' CPU per pass, {median_rounds(total)}; worker nodes "
                  f"{median_rounds(nodes)}; coordinator {median_rounds(coord)}; "
                  f"wall median {statistics.median(wall):.1f} ms")
    save(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
