"""MAP nodes at scale: does an item's event cost grow with the number of items?

For MAP nodes of 10, 1,000 and 10,000 items, one session claims the items and
completes them one by one through ``Engine.complete`` (the shell's whole event
transaction: run lock, node rows, the one item, counters, the next dispatch), timing
each completion on the client. ``max_parallel`` is 2, so at every size all but the
last two completions dispatch the next item: the events compared do the same work
(with 10 items and a wide ``max_parallel`` most events would dispatch nothing). The 10-item case runs 100 runs, so
every size has at least 1,000 events. The last completion of a node (the one that
assembles the node's output) is reported apart. Two rounds, the sizes in opposite
orders, each on a fresh database; the figure is the median event time per size (of
its rounds' medians) and its ratio to the 10-item median (flat within 20% is the
goal). ``make bench`` runs the 10,000-item case in the first round only
(``--largest-rounds 1``): one run of 10,000 events, 70 to 90 s of its 15 minutes on
this machine. Every run must finish SUCCEEDED with one output per item.

    python -m bench.mapitems              # on the embedded server
    python -m bench.mapitems --pgbin DIR  # on a throwaway cluster of those binaries
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import scenario
from composer_ops import Engine
from composer_ops.db.migrate import migrate
from composer_ops.testing import servers

SIZES = (10, 1_000, 10_000)
SPEC = {"id": "bench-map", "nodes": [
    {"id": "each", "type": "MAP", "items": "$.input.ids", "task": "item", "queue": "map", "max_parallel": 2}]}


def _one_size(url: str, size: int, events_at_least: int) -> dict[str, Any]:
    times: list[float] = []
    last: list[float] = []
    starts: list[float] = []
    runs = max(1, events_at_least // size)
    with Engine.connect(url, pool_size=2, application_name="bench-map") as engine:
        engine.deploy(SPEC)
        for _ in range(runs):
            t = time.perf_counter()
            run_id = engine.start("bench-map", input={"ids": list(range(size))})
            starts.append(time.perf_counter() - t)
            done = 0
            while done < size:
                claims = engine.claim(["map"], "bench", 50)
                for claim in claims:
                    t = time.perf_counter()
                    engine.complete(claim, claim.input["index"])
                    elapsed = time.perf_counter() - t
                    done += 1
                    (last if done == size else times).append(elapsed)
            run = engine.get_run(run_id)
            if run.status != "SUCCEEDED" or run.output != {"each": list(range(size))}:
                raise RuntimeError(f"MAP of {size} items ended {run.status}")
    return {"size": size, "runs": runs, "events": len(times), "event_ms_p50": statistics.median(times) * 1000,
            "event_ms_p90": statistics.quantiles(times, n=10)[-1] * 1000,
            "last_event_ms_p50": statistics.median(last) * 1000, "start_ms_p50": statistics.median(starts) * 1000}


def measure(server: servers.Server, *, sizes: tuple[int, ...] = SIZES, rounds: int = 2, events_at_least: int = 1_000,
            largest_rounds: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The rounds' results and, per size, the median of the rounds' event medians and
    its ratio to the smallest size's. ``largest_rounds``: the largest size runs in the
    first that many rounds only (each of its rounds is one run of that many events:
    ``make bench`` runs it once, to stay within its time); None: in every round."""
    results: list[dict[str, Any]] = []
    largest = max(sizes)
    for r in range(rounds):
        for size in (sizes if r % 2 == 0 else tuple(reversed(sizes))):
            if size == largest and largest_rounds is not None and r >= largest_rounds:
                continue
            name = f"bench_map_{size}_{r}"
            url = server.create_database(name)
            try:
                migrate(url)
                log(f"MAP of {size:,} items, round {r + 1}/{rounds}")
                results.append({"round": r, **_one_size(url, size, events_at_least)})
            finally:
                server.drop_database(name)
    by_size = {size: statistics.median(x["event_ms_p50"] for x in results if x["size"] == size) for size in sizes}
    base = by_size[sizes[0]]
    return {"rounds": results, "event_ms_p50_by_size": {str(k): v for k, v in by_size.items()},
            "event_ratio_by_size": {str(k): v / base for k, v in by_size.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mapitems", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pgbin", type=Path, help="PostgreSQL server binaries (default: the embedded server)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--largest-rounds", type=int, default=None,
                   help="run the largest size in the first N rounds only (default: every round)")
    args = p.parse_args(argv)
    server = scenario.start_server(args.pgbin)
    def log(message: str) -> None:
        sys.stderr.write(f"[map {time.strftime('%H:%M:%S')}] {message}\n")

    out = measure(server, rounds=args.rounds, largest_rounds=args.largest_rounds, log=log)
    print(json.dumps({"server_version": server.version, **out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
