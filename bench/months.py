"""Does the hot path's cost grow with the months retained?

Three databases on one server hold 1, 6 and 24 complete months of history before the
current one (written by the simulator's backfill, ``composer_ops.simulate.months``,
``--months-runs`` runs per month on average), each with the current month and three
ahead as partition upkeep keeps them. The 24-month database is backfilled once; the
6- and 1-month ones are copies of it with the older months dropped by retention
(``composer_drop_partitions``), so the recent months are the same rows in all three.
Then, in rounds that alternate the order of the three databases:

- **latency and server CPU per call**, one session, no other load: ``claims`` 1-task
  runs are started, and each task is claimed (``Engine.claim``, limit 1), heartbeated
  and completed, each call timed on the client (p50, p99) and the session's server
  process's CPU read from /proc around it (mean per call; a server on this machine
  only);
- **relation locks held** by one call of each hot statement, counted in
  ``pg_locks`` inside its transaction (minus what the counting query itself holds),
  after the statement has run often enough on the connection to be prepared: the
  claim, a heartbeat, a completion (the shell's whole event transaction), the lease
  sweeper's and the timer loop's scans (from the coordinator's active floor on, as it
  runs them), and the read of that floor (once every ``floor_every_s``, 30 s);
- **1-task throughput**: the sustained workload of ``make bench`` (W=1 worker process,
  the coordinator, the producer at a bounded backlog) on that database; only runs
  started inside the window count, so the history does not.

``python -m bench.months`` runs it alone (``--pgbin DIR`` for another server).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import psycopg

from bench import scenario
from bench.report import require_binaries
from bench.workload import COMPOSER, WORKFLOWS
from composer_ops.testing.servers import Server

MONTHS = (1, 6, 24)
_COUNT_LOCKS = ("SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def build(server: Server, months: tuple[int, ...], runs_per_month: int, seed: int = 11) -> dict[int, str]:
    """A database per entry of ``months``: the largest backfilled, the others copies
    of it whose older months retention dropped. Returns months -> database name."""
    from composer_ops import Engine
    from composer_ops.core.runids import RUN_ID_MAX_AGE, month_start
    from composer_ops.core.spec import parse_spec
    from composer_ops.db.migrate import migrate
    from composer_ops.repo import retention
    from composer_ops.simulate.definitions import definitions, deploy_definitions
    from composer_ops.simulate.months import MonthsOptions, backfill, generated_months

    most = max(months)
    base = f"bench_months_{most}"
    url = server.create_database(base)
    migrate(url)
    with Engine.connect(url, pool_size=1, application_name="bench-setup") as engine:
        deployed = deploy_definitions(engine)
        for spec in WORKFLOWS.values():
            engine.deploy(spec)
        with engine.pool.connection() as conn:
            row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    now: datetime = row[0]
    specs = {doc["id"]: parse_spec(doc) for doc in definitions()}
    backfill(url, specs, {wf: v for wf, (v, _) in deployed.items()},
             MonthsOptions(seed=seed, months=most, runs_per_month=runs_per_month, stuck_months=1), now=now)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    names = {most: base}
    for m in sorted(set(months) - {most}):
        name = f"bench_months_{m}"
        names[m] = name
        copy = server.create_database(name, template=base)
        first = generated_months(now, m)[0]
        with psycopg.connect(copy) as conn:
            retention.drop(conn, month_start(first), min_age=RUN_ID_MAX_AGE)
            conn.commit()
    return names


def shape(url: str) -> dict[str, int]:
    """Partitions of task_instances and the rows in them."""
    with psycopg.connect(url) as conn:
        row = conn.execute("""
            SELECT (SELECT count(*) FROM pg_inherits WHERE inhparent = 'task_instances'::regclass),
                   (SELECT count(*) FROM task_instances), (SELECT count(*) FROM workflow_runs)""").fetchone()
    assert row is not None
    return {"partitions_per_table": int(row[0]), "task_rows": int(row[1]), "runs": int(row[2])}


def _locks_held(engine: Any, op: Any, repeat: int = 7) -> int:
    """Relation locks one call of ``op(conn)`` holds at the end of its transaction,
    on a connection where it has run ``repeat`` times (prepared after 5)."""
    held = 0
    with engine.pool.connection() as conn:
        for _ in range(repeat):
            with conn.transaction():
                base = conn.execute(_COUNT_LOCKS).fetchone()[0]
                raise_rollback = op(conn)
                held = conn.execute(_COUNT_LOCKS).fetchone()[0] - base
                if raise_rollback:
                    raise psycopg.Rollback()
    return int(held)


def locks(url: str) -> dict[str, int]:
    """Locks held by one call of each hot-path statement (see the module doc)."""
    from composer_ops import Engine
    from composer_ops.repo import clock, outbox, signals, tasks, writes

    out: dict[str, int] = {}
    with Engine.connect(url, pool_size=1, application_name="bench-months") as engine:
        for _ in range(8):
            engine.start(WORKFLOWS["one"]["id"])

        def claim(conn: Any) -> bool:
            outbox.claim(conn, ["default"], "bench-locks", 1, task_names=["noop"], claim_id="bench-locks")
            return True          # rolled back: the next repetition claims the same task

        out["claim"] = _locks_held(engine, claim)
        held = engine.claim(["default"], "bench-locks", 1, task_names=["noop"])[0]

        def heartbeat(conn: Any) -> bool:
            tasks.heartbeat(conn, _ref(held), held.lease_owner, held.lease_s)
            return False

        out["heartbeat"] = _locks_held(engine, heartbeat)
        # The scans as the coordinator runs them: from its active floor on.
        with engine.pool.connection() as conn:
            floor = engine.coordinator().active_floor(conn)
        out["sweeper scan"] = _locks_held(
            engine, lambda conn: bool(tasks.expired_leases(conn, 100, now=clock.now(conn), floor=floor)) and False)
        out["timer scan"] = _locks_held(
            engine, lambda conn: bool(signals.due_waits(conn, 100, now=clock.now(conn), floor=floor)) and False)
        out["active floor read"] = _locks_held(engine, lambda conn: bool(tasks.active_floor(conn)) and False)
        # A completion is the shell's event transaction: count inside it, after its one
        # write (repo/writes.py) and before the COMMIT pipelined with it.
        counted: list[int] = []
        send = writes.send

        def send_and_count(conn: Any, doc: Any) -> Any:
            sent = send(conn, doc)
            counted.append(int(conn.execute(_COUNT_LOCKS).fetchone()[0]))
            return sent

        writes.send = send_and_count
        try:
            with engine.pool.connection() as conn, conn.transaction():
                base = int(conn.execute(_COUNT_LOCKS).fetchone()[0])   # type: ignore[index]
            engine.complete(held, None)
            for claimed in engine.claim(["default"], "bench-locks", 7, task_names=["noop"]):
                engine.complete(claimed, None)
        finally:
            writes.send = send
        out["complete (event transaction)"] = counted[-1] - base
    return out


def _ref(claim: Any) -> Any:
    from composer_ops.core.model import TaskRef

    return TaskRef(task_id=claim.task_id, run_id=claim.run_id, node_id=claim.node_id, attempt=claim.attempt,
                   lease_owner=claim.lease_owner)


def latency(url: str, claims: int) -> dict[str, Any]:
    """Client-side latency of claim, heartbeat and complete, one session, no other load,
    and the CPU the session's server process spent on each (from /proc, summed over the
    calls: unlike the latency, it does not move with what else runs on the machine)."""
    from composer_ops import Engine

    ops = ("claim", "heartbeat", "complete")
    timings: dict[str, list[float]] = {op: [] for op in ops}
    cpu = dict.fromkeys(ops, 0.0)
    with Engine.connect(url, pool_size=1, application_name="bench-months") as engine:
        with engine.pool.connection() as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
        backend = _Backend(int(row[0]) if row else 0)
        for _ in range(claims):
            engine.start(WORKFLOWS["one"]["id"])
        empty = 0
        for _ in range(claims):
            for _attempt in range(50):
                c0, t0 = backend.seconds(), time.perf_counter()
                got = engine.claim(["default"], "bench-latency", 1, task_names=["noop"])
                t1, c1 = time.perf_counter(), backend.seconds()
                if got:
                    break
                empty += 1
                time.sleep(0.01)
            else:
                raise RuntimeError(f"no queued task could be claimed: {_outbox(url)}")
            engine.heartbeat(got[0])
            t2, c2 = time.perf_counter(), backend.seconds()
            engine.complete(got[0], None)
            t3, c3 = time.perf_counter(), backend.seconds()
            for op, (start, end), (cpu0, cpu1) in zip(ops, ((t0, t1), (t1, t2), (t2, t3)),
                                                       ((c0, c1), (c1, c2), (c2, c3)), strict=True):
                timings[op].append((end - start) * 1000)
                cpu[op] += cpu1 - cpu0
    return {**{op: {"p50_ms": _percentile(v, 0.5), "p99_ms": _percentile(v, 0.99),
                    "server_cpu_ms": cpu[op] / claims * 1000 if backend.readable else None}
               for op, v in timings.items()},
            "empty_claims": empty}


class _Backend:
    """CPU seconds of one server process (0 when it is not on this machine)."""

    def __init__(self, pid: int) -> None:
        try:
            self._proc: psutil.Process | None = psutil.Process(pid)
            self._proc.cpu_times()
        except (psutil.Error, ValueError):
            self._proc = None

    @property
    def readable(self) -> bool:
        return self._proc is not None

    def seconds(self) -> float:
        if self._proc is None:
            return 0.0
        t = self._proc.cpu_times()
        return float(t.user + t.system)


def _outbox(url: str) -> list[Any]:
    """What the outbox holds for the benchmark's handler (to explain an empty claim)."""
    with psycopg.connect(url) as conn:
        return conn.execute("""
            SELECT o.queue, o.attempt, t.attempt, t.state, o.available_at > now(), count(*)
              FROM task_outbox o LEFT JOIN task_instances t ON t.run_id = o.run_id AND t.id = o.task_id
             WHERE o.task_name = 'noop' GROUP BY 1, 2, 3, 4, 5""").fetchall()


def measure(server: Server, *, months: tuple[int, ...] = MONTHS, runs_per_month: int = 2000, claims: int = 400,
            rounds: int = 2, duration: float = 6.0, max_backlog: int = 50,
            log: Any = None) -> dict[str, Any]:
    began = time.monotonic()
    names = build(server, months, runs_per_month)
    built_s = time.monotonic() - began
    urls = {m: server.url(n) for m, n in names.items()}
    per: dict[int, dict[str, Any]] = {m: {**shape(u), "rounds": []} for m, u in urls.items()}
    try:
        for m, u in urls.items():
            per[m]["locks"] = locks(u)
        for r in range(rounds):
            order = sorted(urls) if r % 2 == 0 else sorted(urls, reverse=True)
            for m in order:
                if log:
                    log(f"months retained {m}, round {r + 1}/{rounds}")
                lat = latency(urls[m], claims)
                server.checkpoint()
                sus = scenario.sustained_on(COMPOSER, urls[m], workers=1, duration=duration,
                                            max_backlog=max_backlog)
                per[m]["rounds"].append({"latency": lat, "runs_per_s": sus["runs_per_s"], "cpu": sus["cpu"]})
    finally:
        for name in names.values():
            server.drop_database(name)
    for entry in per.values():
        rs = entry["rounds"]
        for op in ("claim", "heartbeat", "complete"):
            entry[f"{op}_p50_ms"] = statistics.median(x["latency"][op]["p50_ms"] for x in rs)
            entry[f"{op}_p99_ms"] = statistics.median(x["latency"][op]["p99_ms"] for x in rs)
            cpu = [x["latency"][op]["server_cpu_ms"] for x in rs if x["latency"][op]["server_cpu_ms"] is not None]
            entry[f"{op}_server_cpu_ms"] = statistics.median(cpu) if cpu else None
        entry["runs_per_s"] = statistics.median(x["runs_per_s"] for x in rs)
        entry["claim_locks"] = entry["locks"]["claim"]
    lo, hi = min(per), max(per)

    def ratio(key: str) -> float | None:
        a, b = per[hi].get(key), per[lo].get(key)
        return a / b if a and b else None

    return {
        "runs_per_month": runs_per_month, "claims_per_round": claims, "rounds": rounds, "build_s": built_s,
        "by_months": {str(m): per[m] for m in sorted(per)},
        "claim_locks_by_months": {str(m): per[m]["claim_locks"] for m in sorted(per)},
        f"claim_p50_ratio_{hi}_vs_{lo}_months": ratio("claim_p50_ms"),
        f"claim_p99_ratio_{hi}_vs_{lo}_months": ratio("claim_p99_ms"),
        f"runs_per_s_ratio_{hi}_vs_{lo}_months": ratio("runs_per_s"),
        f"claim_server_cpu_ratio_{hi}_vs_{lo}_months": ratio("claim_server_cpu_ms"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.months", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pgbin", default="", help="server binaries to start a cluster from (default: embedded)")
    parser.add_argument("--months", default=",".join(map(str, MONTHS)))
    parser.add_argument("--months-runs", type=int, default=2000, help="runs per backfilled month")
    parser.add_argument("--claims", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=6.0)
    args = parser.parse_args(argv)
    require_binaries(parser, args.pgbin)
    server = scenario.start_server(Path(args.pgbin) if args.pgbin else None)

    def log(msg: str) -> None:
        sys.stderr.write(f"[months {time.strftime('%H:%M:%S')}] {msg}\n")

    result = measure(server, months=tuple(int(x) for x in args.months.split(",")), runs_per_month=args.months_runs,
                     claims=args.claims, rounds=args.rounds, duration=args.duration, log=log)
    print(json.dumps({"server_version": server.version, **result}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
