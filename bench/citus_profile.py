"""Where a Citus run's cost goes: one event kind at a time, on a local cluster.

``python -m bench.citus_profile [--runs 200] [--passes 20] [--shards 32] [--worker-nodes 2] [--json PATH]``
starts a coordinator and two worker nodes (or ``--worker-nodes``) (:mod:`composer_ops.testing.citus`, Debian's
PostgreSQL 15, ``pg_stat_statements`` preloaded, Citus's two-phase commit recovery off so
that ``pg_dist_transaction`` keeps one row per worker group per two-phase commit), makes a
database with ``composer-ops migrate``'s Citus series, and measures, from one client in
this process, one phase at a time:

- ``start``: ``runs`` starts of a 1-task workflow;
- ``claim``: ``runs`` claims of one task each;
- ``complete``: ``runs`` completions;
- ``coordinator``: ``passes`` passes of every coordinator loop (``run_once``) with
  nothing to do, and the same on a database holding active runs.

For each phase and node: CPU (the node's postmaster and every child, split by backend
kind, the backends that exited during the phase as one line), sessions opened
(``pg_stat_database.sessions``), two-phase commits (``pg_dist_transaction``: rows and
distributed transactions) and the top statements by execution time
(``pg_stat_statements``, shard names folded). It prints a table and writes JSON.
Everything runs on one machine, shared with other jobs: compare the figures of one run
with each other, not with another machine's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import psycopg

from bench.workload import ONE_TASK
from composer_ops.testing.citus import CitusCluster
from composer_ops.testing.servers import Server, with_database

#: Server settings of the profiled cluster, on top of composer_ops.testing.citus's.
PROFILE_SETTINGS = {
    "shared_preload_libraries": "citus,pg_stat_statements",
    "citus.recover_2pc_interval": "-1",     # keep pg_dist_transaction's rows: they are the count
    "fsync": "on", "max_connections": "200",
}
_SHARD = re.compile(r"_\d{6,}\b")
_SPACE = re.compile(r"\s+")


@dataclass
class NodeSnapshot:
    cpu_total: float
    cpu_by_pid: dict[int, tuple[str, float]]
    sessions: int


@dataclass
class Phase:
    name: str
    items: int
    seconds: float = 0.0
    client_cpu_s: float = 0.0
    two_phase_rows: int = 0
    two_phase_transactions: int = 0
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "items": self.items, "seconds": self.seconds,
                "client_cpu_ms_per_item": 1000 * self.client_cpu_s / max(1, self.items),
                "two_phase_rows": self.two_phase_rows, "two_phase_transactions": self.two_phase_transactions,
                "nodes": self.nodes}


class Probe:
    """Snapshots of every node of ``cluster`` in database ``db``, through one connection
    per node opened once (so the probe's own sessions are counted before, never during)."""

    def __init__(self, cluster: CitusCluster, db: str) -> None:
        self.names = ["coordinator"] + [f"worker{i + 1}" for i in range(len(cluster.workers))]
        self.servers: list[Server] = cluster.nodes
        self.db = db
        self.conns = [psycopg.connect(with_database(s.admin_url, db), autocommit=True,
                                      application_name="profile-probe") for s in self.servers]
        self.postmasters = [_postmaster(c) for c in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.close()

    def reset_statements(self) -> None:
        for conn in self.conns:
            conn.execute("SELECT pg_stat_statements_reset()")

    def two_phase(self) -> tuple[int, int]:
        """Rows of pg_dist_transaction, and the distributed transactions they belong to."""
        row = self.conns[0].execute(
            r"""SELECT count(*), count(DISTINCT substring(gid from '^citus_\d+_\d+_\d+'))
                  FROM pg_dist_transaction""").fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def snapshot(self) -> list[NodeSnapshot]:
        out = []
        for conn, postmaster in zip(self.conns, self.postmasters, strict=True):
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", (self.db,)).fetchone()
            kinds = {int(pid): _kind(str(btype or ""), str(app or "")) for pid, btype, app in conn.execute(
                "SELECT pid, backend_type, application_name FROM pg_stat_activity").fetchall()}
            total, by_pid = _cpu(postmaster, kinds)
            out.append(NodeSnapshot(cpu_total=total, cpu_by_pid=by_pid, sessions=int(row[0]) if row else 0))
        return out

    def statements(self, top: int) -> list[list[dict[str, Any]]]:
        """Per node, the ``top`` statements by total execution time, shard names folded."""
        out = []
        for conn in self.conns:
            folded: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
            for query, calls, ms, rows in conn.execute(
                    """SELECT query, calls, total_exec_time, rows FROM pg_stat_statements
                        WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())""").fetchall():
                text = _SPACE.sub(" ", _SHARD.sub("_N", str(query)))[:140]
                if "pg_stat_" in text or "pg_dist_transaction" in text:
                    continue    # the probe's own
                acc = folded[text]
                acc[0] += calls
                acc[1] += ms
                acc[2] += rows
            ranked = sorted(folded.items(), key=lambda kv: -kv[1][1])[:top]
            out.append([{"query": q, "calls": int(c), "exec_ms": round(ms, 1), "rows": int(r)}
                        for q, (c, ms, r) in ranked])
        return out


def _postmaster(conn: psycopg.Connection[Any]) -> psutil.Process:
    row = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'").fetchone()
    assert row is not None
    parent = psutil.Process(int(row[0])).parent()
    assert parent is not None
    return parent


def _kind(backend_type: str, app: str) -> str:
    if backend_type != "client backend":
        return backend_type
    if app.startswith("citus_internal"):
        return "citus connection from a node"
    return f"client {app or '?'}"


def _cpu(postmaster: psutil.Process, kinds: dict[int, str]) -> tuple[float, dict[int, tuple[str, float]]]:
    own = postmaster.cpu_times()
    total = own.user + own.system + own.children_user + own.children_system
    by_pid: dict[int, tuple[str, float]] = {}
    for child in postmaster.children():
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
        by_pid[child.pid] = (kinds.get(child.pid, "other"), t.user + t.system)
    return total, by_pid


def measure(probe: Probe, name: str, items: int, work: Callable[[], object], *, top: int = 8) -> Phase:
    """Run ``work`` and return what it cost on every node."""
    phase = Phase(name=name, items=items)
    probe.reset_statements()
    two0 = probe.two_phase()
    before = probe.snapshot()
    cpu0, t0 = time.process_time(), time.monotonic()
    work()
    phase.seconds = time.monotonic() - t0
    phase.client_cpu_s = time.process_time() - cpu0
    time.sleep(1.5)   # idle backends flush their session counts within a second
    after = probe.snapshot()
    two1 = probe.two_phase()
    phase.two_phase_rows, phase.two_phase_transactions = two1[0] - two0[0], two1[1] - two0[1]
    statements = probe.statements(top)
    for node, b, a, stmts in zip(probe.names, before, after, statements, strict=True):
        by_kind: dict[str, float] = defaultdict(float)
        for pid, (kind, secs) in a.cpu_by_pid.items():
            by_kind[kind] += secs - (b.cpu_by_pid[pid][1] if pid in b.cpu_by_pid else 0.0)
        total = a.cpu_total - b.cpu_total
        by_kind["exited during the phase"] = total - sum(by_kind.values())
        per = max(1, items)
        phase.nodes[node] = {
            "cpu_ms_per_item": 1000 * total / per,
            "cpu_ms_per_item_by_kind": {k: round(1000 * v / per, 3) for k, v in
                                        sorted(by_kind.items(), key=lambda kv: -kv[1]) if abs(v) >= 0.0005},
            "sessions_opened": a.sessions - b.sessions,
            "statements": stmts,
        }
    return phase


def profile(*, runs: int, passes: int, shards: int, settings: dict[str, str],
            log: Callable[[str], None], worker_nodes: int = 2) -> dict[str, Any]:
    from composer_ops import Engine
    from composer_ops.db.migrate import migrate

    cluster = CitusCluster.start(workers=worker_nodes, shard_count=shards,
                                 settings={**PROFILE_SETTINGS, **settings})
    try:
        url = cluster.create_database("profile")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")    # Citus creates it on the workers too
        migrate(url)
        probe = Probe(cluster, "profile")
        engine = Engine.connect(url, pool_size=1, application_name="profile-client")
        coordinator_engine = Engine.connect(url, pool_size=1, application_name="profile-coordinator")
        try:
            engine.deploy(ONE_TASK)
            coordinator = coordinator_engine.coordinator()
            coordinator.run_once()    # the first pass: partitions, connections
            engine.start(ONE_TASK["id"])   # the same for the client
            engine.complete(engine.claim(["default"], "profile", 1)[0], None)
            phases = [measure(probe, "coordinator pass, idle", passes,
                              lambda: _passes(coordinator, passes))]
            log("coordinator idle: done")
            run_ids: list[str] = []
            phases.append(measure(probe, "start", runs,
                                  lambda: run_ids.extend(engine.start(ONE_TASK["id"]) for _ in range(runs))))
            log("start: done")
            phases.append(measure(probe, "coordinator pass, 1 active task per run", passes,
                                  lambda: _passes(coordinator, passes)))
            claims: list[Any] = []
            phases.append(measure(probe, "claim", runs,
                                  lambda: claims.extend(engine.claim(["default"], "profile", 1)[0]
                                                        for _ in range(runs))))
            log("claim: done")
            phases.append(measure(probe, "complete", runs,
                                  lambda: [engine.complete(c, None) for c in claims]))
            log("complete: done")
        finally:
            engine.close()
            coordinator_engine.close()
            probe.close()
        with psycopg.connect(url) as conn:
            got: dict[str, str] = dict(conn.execute("""SELECT name, setting FROM pg_settings WHERE name IN
                ('citus.max_cached_conns_per_worker', 'citus.max_adaptive_executor_pool_size',
                 'citus.shard_count', 'citus.executor_slow_start_interval')""").fetchall())
        return {"runs": runs, "passes": passes, "shards": shards, "worker_nodes": worker_nodes, "settings": got,
                "phases": [p.as_dict() for p in phases]}
    finally:
        cluster.stop()


def _passes(coordinator: Any, passes: int) -> None:
    for _ in range(passes):
        stats = coordinator.run_once()
        if stats.errors:
            raise RuntimeError(f"coordinator pass failed: {stats.errors}")


def render(result: dict[str, Any]) -> str:
    lines = [f"shards {result['shards']}, settings {result['settings']}", ""]
    for p in result["phases"]:
        nodes = p["nodes"]
        cpu = sum(n["cpu_ms_per_item"] for n in nodes.values())
        sessions = {k: v["sessions_opened"] for k, v in nodes.items()}
        lines.append(f"== {p['name']} x{p['items']}: server CPU {cpu:.1f} ms/item "
                     f"(client {p['client_cpu_ms_per_item']:.1f}), "
                     f"{p['seconds'] / p['items'] * 1000:.1f} ms/item wall, "
                     f"two-phase commits {p['two_phase_transactions'] / p['items']:.2f}/item "
                     f"({p['two_phase_rows']} rows), sessions opened {sessions}")
        for name, n in nodes.items():
            lines.append(f"  {name}: {n['cpu_ms_per_item']:.2f} ms/item {n['cpu_ms_per_item_by_kind']}")
            for s in n["statements"][:5]:
                lines.append(f"    {s['exec_ms']:>9.1f} ms {s['calls']:>6} calls  {s['query']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.citus_profile")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--worker-nodes", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra server setting of every node (repeatable)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    extra = dict(s.split("=", 1) for s in args.set)
    result = profile(runs=args.runs, passes=args.passes, shards=args.shards, settings=extra,
                     log=lambda m: print(m, file=sys.stderr, flush=True), worker_nodes=args.worker_nodes)
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["load_average"] = psutil.getloadavg()
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
