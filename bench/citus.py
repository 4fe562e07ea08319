"""The Citus case of ``make bench``: the same Composer workload on a local Citus cluster
(a coordinator and two worker nodes of PostgreSQL 15, :mod:`composer_ops.testing.citus`)
and on the single PostgreSQL 15 server of the benchmark's 15 leg, side by side.

Both get the same server settings (the package defaults the 15 leg uses: fsync on),
the same binaries, the same worker and coordinator processes (which connect to the
coordinator) and the same producer. The two alternate within each round and the order
flips every round, so the machine's drift hits both alike; the ratio is Citus over
the single server, per round, and its median. Every node of the cluster runs on the
same two cores as the processes: what this measures is the cost of the distributed
commit path on one machine, not what more machines would add (docs/scaling.md).

Server CPU per run counts every node of the cluster, without the benchmark's own
polling (its count of unfinished runs, :class:`bench.cpu.SessionPoll`), which is
reported apart; two-phase commits and sessions opened per run are counted over the
same window (:class:`bench.cpu.DbCounters`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import psycopg

from bench import scenario
from bench.workload import COMPOSER, WORKFLOWS
from composer_ops.testing.citus import CitusCluster
from composer_ops.testing.servers import Server

CITUS = dataclasses.replace(COMPOSER, label="composer-citus")


@dataclasses.dataclass(frozen=True)
class ClusterTarget(Server):
    """A Citus cluster as :mod:`bench.scenario` uses a server (its ``admin_url`` is the
    coordinator's): a database per measurement is created, migrated and given the
    workflows (a Citus database cannot be cloned from a template); checkpoints and
    server CPU (``node_urls``, see :func:`bench.cpu.server_cpu`) cover every node."""

    cluster: CitusCluster | None = None

    @classmethod
    def of(cls, cluster: CitusCluster) -> ClusterTarget:
        c = cluster.coordinator
        return cls(admin_url=c.admin_url, kind=c.kind, bin_dir=c.bin_dir, data_dir=c.data_dir, log=c.log,
                   run_as=c.run_as, port=c.port, cluster=cluster)

    @property
    def _nodes(self) -> CitusCluster:
        assert self.cluster is not None
        return self.cluster

    @property
    def node_urls(self) -> tuple[str, ...]:
        return tuple(node.admin_url for node in self._nodes.nodes)

    def create_database(self, name: str, *, template: str | None = None) -> str:
        from composer_ops import Engine
        from composer_ops.db.migrate import migrate

        url = self._nodes.create_database(name)
        migrate(url)
        with Engine.connect(url, pool_size=1, application_name="bench-setup") as engine:
            for spec in WORKFLOWS.values():
                engine.deploy(spec)
        return url

    def drop_database(self, name: str) -> None:
        self._nodes.drop_database(name)

    def checkpoint(self) -> None:
        for node in self._nodes.nodes:
            node.checkpoint()


def measure(server: Server, template: str, *, runs: int, duration: float, max_backlog: int, rounds: int,
            shard_count: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Drain and sustained, W=1, ``rounds`` rounds on each side; returns every result,
    the per-round ratios (Citus / single server) and their medians."""
    settings = {**scenario.PACKAGE_DEFAULTS, "max_connections": "200"}
    # Citus's recovery deletes pg_dist_transaction's rows of committed transactions: off,
    # they are the count of two-phase commits (nothing fails here for it to recover).
    cluster = CitusCluster.start(workers=2, shard_count=shard_count,
                                 settings={**settings, "citus.recover_2pc_interval": "-1"})
    try:
        target = ClusterTarget.of(cluster)
        with psycopg.connect(cluster.coordinator.admin_url) as conn:
            row = conn.execute("SELECT default_version FROM pg_available_extensions WHERE name = 'citus'").fetchone()
            citus_version = str(row[0]) if row else "?"
        results: list[dict[str, Any]] = []
        for r in range(rounds):
            sides: list[tuple[str, Any, Any, str]] = [("single", COMPOSER, server, template),
                                                      ("citus", CITUS, target, "")]
            if r % 2:
                sides.reverse()
            for mode in ("drain", "sustained"):
                order = sides if mode == "drain" else list(reversed(sides))
                for side, system, where, tpl in order:
                    log(f"citus case: {side} {mode}, round {r + 1}/{rounds}")
                    if mode == "drain":
                        result = scenario.drain(system, where, tpl, workers=1, items=runs)
                    else:
                        result = scenario.sustained(system, where, tpl, workers=1, duration=duration,
                                                    max_backlog=max_backlog)
                    result.update(round=r, side=side)
                    results.append(result)
    finally:
        cluster.stop()
    ratios: dict[str, list[float]] = {"drain": [], "sustained": []}
    for r in range(rounds):
        for mode in ratios:
            one = {x["side"]: x for x in results if x["round"] == r and x["mode"] == mode}
            if one.get("single", {}).get("runs_per_s") and one.get("citus", {}).get("runs_per_s") is not None:
                ratios[mode].append(one["citus"]["runs_per_s"] / one["single"]["runs_per_s"])

    def median(side: str, mode: str, key: str) -> float | None:
        values = [x[key] for x in results if x["side"] == side and x["mode"] == mode and x.get(key) is not None]
        return statistics.median(values) if values else None

    def cpu(side: str, mode: str) -> float | None:
        values = [x["cpu"]["server_ms_per_item"] + x["cpu"]["processes_ms_per_item"] for x in results
                  if x["side"] == side and x["mode"] == mode and x["cpu"]["server_ms_per_item"] is not None]
        return statistics.median(values) if values else None

    def per_run(side: str, mode: str, key: str) -> float | None:
        values = [x["cpu"][key] for x in results
                  if x["side"] == side and x["mode"] == mode and x["cpu"].get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "citus_version": citus_version, "nodes": 1 + len(cluster.workers), "shard_count": shard_count,
        "settings": settings, "rounds": rounds, "results": results, "ratios": ratios,
        "summary": {mode: {"single_runs_per_s": median("single", mode, "runs_per_s"),
                           "citus_runs_per_s": median("citus", mode, "runs_per_s"),
                           "ratio": statistics.median(ratios[mode]) if ratios[mode] else None,
                           "single_cpu_ms_per_run": cpu("single", mode),
                           "citus_cpu_ms_per_run": cpu("citus", mode),
                           "citus_two_phase_commits_per_run": per_run("citus", mode, "two_phase_commits_per_item"),
                           "citus_sessions_per_run": per_run("citus", mode, "sessions_per_item"),
                           "single_sessions_per_run": per_run("single", mode, "sessions_per_item"),
                           "citus_bench_poll_ms_per_run": per_run("citus", mode, "bench_poll_server_ms_per_item"),
                           "single_bench_poll_ms_per_run": per_run("single", mode, "bench_poll_server_ms_per_item")}
                    for mode in ratios},
    }
