"""Python function calls and where the client's time goes, per event of a 1-task run.

One Engine with a single pooled connection on a fresh database (as :mod:`bench.roundtrips`),
no concurrency: for start (Engine.start), claim (Engine.claim of one task) and complete
(Engine.complete), the Python function calls per event (``sys.setprofile`` 'call'
events of this thread, builtins excluded) and cProfile's top functions by own time and
by calls per event. Calls are deterministic for a given tree and server: what
``tests/integration/test_engine_calls.py`` holds to a ceiling; the times are the load's.

``python -m bench.calls [--runs N] [--top K]`` prints a JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections.abc import Callable
from typing import Any

from composer_ops.testing.calls import count_calls
from composer_ops.testing.servers import Server


def _top(stats: pstats.Stats, runs: int, key: str, top: int) -> list[dict[str, Any]]:
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{path.rsplit('/site-packages/', 1)[-1].rsplit('/work/', 1)[-1]}:{line}({name})",
                     "calls": round(ncalls / runs, 2), "own_us": round(tottime / runs * 1e6, 1),
                     "inclusive_us": round(cumtime / runs * 1e6, 1)})
    order = {"own": "own_us", "calls": "calls", "inclusive": "inclusive_us"}[key]
    return sorted(rows, key=lambda r: -r[order])[:top]


def measure(server: Server, template: str, *, runs: int = 300, top: int = 25) -> dict[str, Any]:
    from composer_ops import Engine

    db = "bench_calls"
    url = server.create_database(db, template=template)
    try:
        with Engine.connect(url, pool_size=1, application_name="bench-calls") as engine:
            for _ in range(10):     # warm up: definitions cached, statements prepared
                engine.start("bench-one")
            for c in engine.claim(["default"], "calls", 10, task_names=["noop"]):
                engine.complete(c, None)
            claims: list[Any] = []
            events: dict[str, Callable[[], object]] = {
                "start": lambda: engine.start("bench-one"),
                "claim": lambda: claims.extend(engine.claim(["default"], "calls", 1, task_names=["noop"])),
                "complete": lambda: engine.complete(claims.pop(), None),
            }
            out: dict[str, Any] = {"runs": runs}
            for name, event in events.items():
                counted = [count_calls(event) for _ in range(runs // 2)]
                profiler = cProfile.Profile(time.thread_time)   # CPU, not waiting on the server
                cpu0 = time.process_time()
                for _ in range(runs - runs // 2):
                    profiler.runcall(event)
                cpu = time.process_time() - cpu0
                stats = pstats.Stats(profiler)
                n = runs - runs // 2
                out[name] = {"calls_min": min(counted), "calls_max": max(counted),
                             "profiled_cpu_us": round(cpu / n * 1e6, 1),
                             "top_own": _top(stats, n, "own", top), "top_calls": _top(stats, n, "calls", top)}
        return out
    finally:
        server.drop_database(db)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.calls")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    from bench.workload import make_template
    from composer_ops.testing import servers

    server = servers.session().primary
    print(json.dumps(measure(server, make_template(server, "bench_tpl_calls"), runs=args.runs, top=args.top),
                     indent=1))


if __name__ == "__main__":
    main()
