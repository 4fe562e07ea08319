"""Composer's side: the workflows, the worker app, and real ``composer-ops worker`` /
``coordinator`` processes on a database cloned from a migrated template (see
:mod:`bench.scenario`).

A run counts when its ``workflow_runs`` row is completed; its units are its TASK rows.
The worker processes run ``composer-ops worker --app bench.workload:make_worker``: one
no-op handler, as the peer's job, so what is measured is the engine. Each worker has 4
slots, as the peer's, and claims ahead up to 4 tasks beyond them (``prefetch``, from
2026-12-06; ``BENCH_PREFETCH`` sets it, 0 for none), which the peer has no option for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from bench.measure import COMPOSER_UNITS
from bench.procs import ROOT, ProcessGroup, connections, wait_until
from bench.producer import UNFINISHED
from bench.scenario import System
from composer_ops.testing.servers import Server

if TYPE_CHECKING:
    from composer_ops import Engine, TaskContext, Worker

ONE_TASK: dict[str, Any] = {
    "id": "bench-one", "name": "One no-op task",
    "nodes": [{"id": "work", "type": "TASK", "task": "noop"}],
}

FAN_OUT: dict[str, Any] = {
    "id": "bench-fan", "name": "Fan-out to 8, fan-in (10 tasks)",
    "nodes": [
        {"id": "split", "type": "TASK", "task": "noop"},
        *({"id": f"f{i}", "type": "TASK", "task": "noop", "depends_on": ["split"]} for i in range(1, 9)),
        {"id": "join", "type": "TASK", "task": "noop", "depends_on": [f"f{i}" for i in range(1, 9)]},
    ],
}

WORKFLOWS = {"one": ONE_TASK, "fan": FAN_OUT}
CONCURRENCY = 4
#: Tasks each benchmark worker may claim beyond its slots (Worker's ``prefetch``).
PREFETCH = 4
PRODUCER_THREADS = 4


def noop(input: Any, ctx: TaskContext) -> None:
    return None


def make_worker(engine: Engine) -> Worker:
    """The benchmark's worker app: queue ``default``, handler ``noop``."""
    from composer_ops import Worker

    worker = Worker(engine, queues=["default"], concurrency=int(os.environ.get("BENCH_CONCURRENCY", "4")),
                    prefetch=int(os.environ.get("BENCH_PREFETCH", str(PREFETCH))))
    worker.handler("noop")(noop)
    if os.environ.get("BENCH_CLAIM_LOG"):
        _count_claims(worker, os.environ["BENCH_CLAIM_LOG"])
    return worker


def _count_claims(worker: Worker, path: str) -> None:
    """Instrumentation for the benchmark: count claims, how many came back empty and
    the tasks they took, appended as one JSON line to ``path`` when the process exits.
    The claims are the worker's own count (:meth:`Worker.claim_counts`: its claim
    loop's and its reports', which claim in their transactions) where it keeps one;
    a worker of an older tree (bench.ab's before side) is counted at ``Engine.claim``."""
    import atexit
    import json
    import threading

    counts = {"pid": os.getpid(), "claims": 0, "empty": 0, "tasks": 0}
    lock = threading.Lock()
    engine = worker.engine
    claim, complete, fail = engine.claim, engine.complete, engine.fail

    def counted(*args: Any, **kwargs: Any) -> Any:
        got = claim(*args, **kwargs)
        with lock:
            counts["claims"] += 1
            counts["empty"] += not got
            counts["tasks"] += len(got)
        return got

    def reported(report: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            outcome = report(*args, **kwargs)
            with lock:
                counts["tasks"] += len(getattr(outcome, "claimed", None) or ())
            return outcome
        return call

    engine.claim = counted  # type: ignore[method-assign]
    engine.complete = reported(complete)  # type: ignore[method-assign]
    engine.fail = reported(fail)  # type: ignore[method-assign]

    def dump() -> None:
        by_reason = worker.claim_counts() if hasattr(worker, "claim_counts") else None
        if by_reason is not None:
            counts["claims"] = sum(n["claims"] for n in by_reason.values())
            counts["empty"] = sum(n["empty"] for n in by_reason.values())
        with open(path, "a") as f:
            f.write(json.dumps({**counts, "by_reason": by_reason}) + "\n")

    atexit.register(dump)


def make_template(server: Server, name: str, target: int | None = None) -> str:
    """A database migrated to ``target`` (default: every migration) with both
    benchmark workflows deployed; scenarios clone it."""
    from composer_ops import Engine
    from composer_ops.db.migrate import migrate

    url = server.create_database(name)
    migrate(url, target=target)
    with Engine.connect(url, pool_size=1, application_name="bench-setup") as engine:
        for spec in WORKFLOWS.values():
            engine.deploy(spec)
    return name


def spawn_cluster(url: str, workers: int, root: Path = ROOT, *, coordinators: int = 1) -> ProcessGroup:
    """W worker processes (concurrency 4 each) and the coordinator, ready to work."""
    group = ProcessGroup(f"composer x{workers}", root)
    env = {"COMPOSER_DATABASE_URL": url, "BENCH_CONCURRENCY": str(CONCURRENCY), **group.count_claims()}
    for _ in range(workers):
        group.spawn(["-m", "composer_ops", "worker", "--app", "bench.workload:make_worker"], env=env)
    for _ in range(coordinators):
        group.spawn(["-m", "composer_ops", "coordinator", "--interval", "0.5"], env=env)
    wait_until(lambda: connections(url, "composer-listen") >= workers
               and connections(url, "composer-coordinator") >= coordinators,
               timeout=60, what=f"{workers} composer workers and the coordinator", group=group)
    return group


def run_window(url: str, window: tuple[Any, Any] | None) -> tuple[int, int, Any]:
    """Runs created and completed inside the window, and the last completion."""
    w0, w1 = window if window else (None, None)
    with psycopg.connect(url) as conn:
        row: Any = conn.execute("""
            WITH w AS (SELECT COALESCE(%(w0)s::timestamptz, '-infinity') AS w0,
                              COALESCE(%(w1)s::timestamptz, 'infinity') AS w1)
            SELECT count(*) FILTER (WHERE r.created_at >= w.w0 AND r.created_at < w.w1),
                   count(*) FILTER (WHERE r.completed_at >= w.w0 AND r.completed_at < w.w1),
                   max(r.completed_at)
              FROM workflow_runs r, w""", {"w0": w0, "w1": w1}).fetchone()
    return int(row[0]), int(row[1]), row[2]


COMPOSER = System(name="composer", concurrency=CONCURRENCY, units_sql=COMPOSER_UNITS, spawn=spawn_cluster,
                  unfinished_sql=UNFINISHED["composer"], runs_window=run_window)
