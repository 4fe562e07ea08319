"""The peer: the same 1-task workload on Procrastinate 3, against the same server.

Procrastinate is installed into the benchmark's environment by ``make bench`` (it is
not a dependency of composer_ops). Its job is an ``async`` no-op, its best case: a
sync task would add a thread hop per job. Workers run at concurrency 4 with every
other option at its default (LISTEN/NOTIFY on, jobs kept after success), as
``procrastinate worker`` would. The measurements are :mod:`bench.scenario`'s, the
same code as Composer's.

``python -m bench.peer_procrastinate worker --url URL`` is the worker process.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.measure import PROCRASTINATE_UNITS, unit_stats
from bench.procs import ROOT, ProcessGroup, scalar, wait_until
from bench.producer import UNFINISHED
from bench.scenario import System
from composer_ops.testing.servers import Server

CONCURRENCY = 4


def make_app(url: str, *, pool_size: int = 4, application_name: str = "bench-procrastinate") -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(
        conninfo=url, min_size=1, max_size=pool_size, kwargs={"application_name": application_name}))

    async def noop() -> None:
        return None

    # Registered by a call, not decorator syntax: in a tree where procrastinate is not
    # installed yet (`make bench` installs it) mypy sees it as untyped.
    app.task(name="noop", queue="default")(noop)
    return app


def version() -> str:
    from importlib.metadata import version as dist_version

    return dist_version("procrastinate")


def installed() -> bool:
    """Whether Procrastinate can be imported here (`make bench` installs it)."""
    try:
        version()
        import procrastinate  # noqa: F401
    except Exception:
        return False
    return True


def make_template(server: Server, name: str) -> str:
    """A database with Procrastinate's schema; scenarios clone it."""
    url = server.create_database(name)
    app = make_app(url, pool_size=1)
    with app.open():
        app.schema_manager.apply_schema()
    return name


def spawn_workers(url: str, workers: int, root: Path = ROOT) -> ProcessGroup:
    group = ProcessGroup(f"procrastinate x{workers}", root)
    for _ in range(workers):
        group.spawn(["-m", "bench.peer_procrastinate", "worker", "--url", url])
    wait_until(lambda: int(scalar(url, "SELECT count(*) FROM procrastinate_workers")) >= workers,
               timeout=60, what=f"{workers} procrastinate workers", group=group)
    return group


def _jobs_window(url: str, window: tuple[Any, Any] | None) -> tuple[int, int, Any]:
    """A job is a run: deferred and succeeded inside the window, and the last success."""
    stats = unit_stats(url, PROCRASTINATE_UNITS, window)
    return stats.created_in_window, stats.finished_in_window, stats.last_finish


PROCRASTINATE = System(name="procrastinate", concurrency=CONCURRENCY, units_sql=PROCRASTINATE_UNITS,
                       spawn=spawn_workers, unfinished_sql=UNFINISHED["procrastinate"], runs_window=_jobs_window)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_procrastinate")
    parser.add_argument("command", choices=["worker"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    args = parser.parse_args()
    app = make_app(args.url, pool_size=args.concurrency + 2)
    app.run_worker(queues=["default"], concurrency=args.concurrency, install_signal_handlers=True)


if __name__ == "__main__":
    main()
