"""The Citus case of ``make bench``: the same Composer workload on a local Citus cluster
(a coordinator and two worker nodes of PostgreSQL 15, :mod:`composer_ops.testing.citus`)
and on the single PostgreSQL 15 server of the benchmark's 15 leg, side by side. With
more than one worker-node count (``python -m bench.run --citus-worker-nodes 2,4``) each
count is a cluster of its own and a side of its own in every round.

Both get the same server settings (the package defaults the 15 leg uses: fsync on),
the same binaries, the same worker and coordinator processes (which connect to the
coordinator) and the same producer. The sides alternate within each round and the order
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
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from bench import scenario
from bench.measure import median
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
            shard_count: int, log: Callable[[str], None], worker_nodes: Sequence[int] = (2,)) -> dict[str, Any]:
    """Drain and sustained, W=1, ``rounds`` rounds on each side; returns every result,
    the per-round ratios (Citus / single server) and their medians.

    ``worker_nodes``: one cluster per count (a coordinator and that many worker nodes,
    all started before the first round), each a side of its own in every round, in the
    same alternation as the single server. ``summary`` and ``ratios`` are those of the
    first count; ``by_worker_nodes`` has each count's, with its per-round ratio to the
    first count's cluster as well."""
    counts = list(dict.fromkeys(worker_nodes))
    if not counts or min(counts) < 1:
        raise ValueError(f"worker_nodes takes counts of at least 1, got {list(worker_nodes)}")
    settings = {**scenario.PACKAGE_DEFAULTS, "max_connections": "200"}
    clusters: dict[int, CitusCluster] = {}
    results: list[dict[str, Any]] = []
    try:
        for n in counts:
            # Citus's recovery deletes pg_dist_transaction's rows of committed transactions: off,
            # they are the count of two-phase commits (nothing fails here for it to recover).
            clusters[n] = CitusCluster.start(workers=n, shard_count=shard_count,
                                             settings={**settings, "citus.recover_2pc_interval": "-1"})
        targets = {n: ClusterTarget.of(cluster) for n, cluster in clusters.items()}
        with psycopg.connect(clusters[counts[0]].coordinator.admin_url) as conn:
            row = conn.execute("SELECT default_version FROM pg_available_extensions WHERE name = 'citus'").fetchone()
            citus_version = str(row[0]) if row else "?"
        for r in range(rounds):
            sides: list[tuple[str, Any, Any, str, int | None]] = [("single", COMPOSER, server, template, None)]
            sides += [("citus", CITUS, targets[n], "", n) for n in counts]
            if r % 2:
                sides.reverse()
            for mode in ("drain", "sustained"):
                order = sides if mode == "drain" else list(reversed(sides))
                for side, system, where, tpl, workers in order:
                    label = side if workers is None else f"citus, {workers} worker nodes"
                    log(f"citus case: {label} {mode}, round {r + 1}/{rounds}")
                    if mode == "drain":
                        result = scenario.drain(system, where, tpl, workers=1, items=runs)
                    else:
                        result = scenario.sustained(system, where, tpl, workers=1, duration=duration,
                                                    max_backlog=max_backlog)
                    result.update(round=r, side=side, worker_nodes=workers)
                    results.append(result)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    by_nodes = {n: _summarize(results, rounds, n, counts[0]) for n in counts}
    first = by_nodes[counts[0]]
    return {
        "citus_version": citus_version, "nodes": 1 + counts[0], "worker_nodes": counts, "shard_count": shard_count,
        "settings": settings, "rounds": rounds, "results": results, "ratios": first["ratios"],
        "summary": first["summary"], "by_worker_nodes": {str(n): s for n, s in by_nodes.items()},
    }


def _summarize(results: list[dict[str, Any]], rounds: int, nodes: int, baseline_nodes: int) -> dict[str, Any]:
    """The figures of the cluster of ``nodes`` worker nodes against the single server,
    and its per-round throughput ratio to the cluster of ``baseline_nodes``."""
    def of(side: str, mode: str, n: int | None = None) -> list[dict[str, Any]]:
        return [x for x in results if x["side"] == side and x["mode"] == mode
                and (side == "single" or x.get("worker_nodes") == n)]

    def per_round(mode: str, over: list[dict[str, Any]], under: list[dict[str, Any]]) -> list[float]:
        out = []
        for r in range(rounds):
            top = [x["runs_per_s"] for x in over if x["round"] == r and x.get("runs_per_s") is not None]
            bottom = [x["runs_per_s"] for x in under if x["round"] == r and x.get("runs_per_s")]
            if top and bottom:
                out.append(top[0] / bottom[0])
        return out

    def cpu(rows: list[dict[str, Any]]) -> float | None:
        return median([x["cpu"]["server_ms_per_item"] + x["cpu"]["processes_ms_per_item"] for x in rows
                       if x["cpu"]["server_ms_per_item"] is not None])

    def per_run(rows: list[dict[str, Any]], key: str) -> float | None:
        return median([x["cpu"][key] for x in rows if x["cpu"].get(key) is not None])

    ratios = {mode: per_round(mode, of("citus", mode, nodes), of("single", mode)) for mode in ("drain", "sustained")}
    to_baseline = {mode: per_round(mode, of("citus", mode, nodes), of("citus", mode, baseline_nodes))
                   for mode in ratios}
    summary = {}
    for mode in ratios:
        single, citus = of("single", mode), of("citus", mode, nodes)
        summary[mode] = {
            "single_runs_per_s": median([x["runs_per_s"] for x in single if x.get("runs_per_s") is not None]),
            "citus_runs_per_s": median([x["runs_per_s"] for x in citus if x.get("runs_per_s") is not None]),
            "ratio": median(ratios[mode]),
            f"ratio_to_{baseline_nodes}_worker_nodes": median(to_baseline[mode]),
            "single_cpu_ms_per_run": cpu(single),
            "citus_cpu_ms_per_run": cpu(citus),
            "citus_two_phase_commits_per_run": per_run(citus, "two_phase_commits_per_item"),
            "citus_sessions_per_run": per_run(citus, "sessions_per_item"),
            "single_sessions_per_run": per_run(single, "sessions_per_item"),
            "citus_bench_poll_ms_per_run": per_run(citus, "bench_poll_server_ms_per_item"),
            "single_bench_poll_ms_per_run": per_run(single, "bench_poll_server_ms_per_item")}
    return {"worker_nodes": nodes, "ratios": ratios, f"ratios_to_{baseline_nodes}_worker_nodes": to_baseline,
            "summary": summary}
