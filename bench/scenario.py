"""The two measurements, written once for both systems.

- :func:`drain`: N items (Composer runs / Procrastinate jobs) are produced first by a
  producer process of 4 threads (that rate is reported as the start rate), then W
  worker processes drain
  them. Throughput = items / (first claim .. last completion), database timestamps.
- :func:`sustained`: W workers run while a producer process adds items for
  ``warmup + duration`` seconds, either held to a bounded backlog (at most
  ``max_backlog`` unfinished items: the rate the system sustains end to end without
  its backlog growing) or paced at a fixed rate (for latency at moderate load).
  Throughput = items completed inside the measured window of ``duration`` seconds,
  which starts ``warmup`` seconds after the producer's first item exists: by then its
  pool and its backlog session have grown, so the window measures the system's
  sessions, not the benchmark's (:class:`WindowClock`).

Each measurement runs in a fresh database cloned from the system's template and
reports CPU per item (server, and the benchmark's own processes) next to the rates.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench.cpu import Meter, ServerCPU, SessionPoll, per_item_ms, server_cpu
from bench.measure import rate, seconds, unit_stats
from bench.procs import ROOT, ProcessGroup, read_json_line, wait_until
from bench.producer import PRODUCED
from composer_ops.testing import servers
from composer_ops.testing.servers import Server

PRODUCER_THREADS = 4
#: How much longer than ``warmup + duration`` the sustained producer runs: its seconds
#: count from the start of its loop, and the window starts ``warmup`` after its first
#: item is seen, so without this slack it would stop before the window ends (its first
#: start connects, and the wait polls every 50 ms).
PRODUCER_SLACK_S = 3.0
#: How often the drain checks whether every item finished, on one connection
#: (:class:`bench.cpu.SessionPoll`); its server CPU is reported apart.
DRAIN_POLL_S = 0.25

#: Debian's PostgreSQL 15 server binaries: the benchmark's second server.
DEBIAN_PG15_BIN = Path("/usr/lib/postgresql/15/bin")
#: A cluster started for the benchmark keeps the package defaults that the shared
#: server manager changes for the test suite (fsync off, 200 connections).
PACKAGE_DEFAULTS = {"fsync": "on", "max_connections": "100"}


def start_server(pgbin: Path | None = None, settings: dict[str, str] | None = None) -> Server:
    """The server of one benchmark leg: ``COMPOSER_DATABASE_URL``'s if set, else a
    throwaway cluster of ``pgbin``'s binaries with the package defaults (and
    ``settings``), else the throwaway embedded server. Stopped and deleted at exit."""
    url = os.environ.get(servers.ENV_URL)
    if url:
        return servers.external(url)
    if pgbin is not None:
        return servers.start_cluster(pgbin, settings={**PACKAGE_DEFAULTS, **(settings or {})})
    return servers.start_embedded()


@dataclass(frozen=True)
class System:
    """What the scenarios need to know about one system."""

    name: str                                                 # "composer" | "procrastinate" (bench.producer)
    concurrency: int
    units_sql: str                                            # see bench.measure
    spawn: Callable[[str, int, Path], ProcessGroup]           # (url, workers, root) -> ready workers
    unfinished_sql: str                                       # unfinished items (bench.producer.UNFINISHED)
    runs_window: Callable[[str, tuple[Any, Any] | None], tuple[int, int, Any]]  # created, completed, last
    root: Path = ROOT                                         # source tree its processes import
    label: str = ""                                           # how results name it (default: name)

    @property
    def tag(self) -> str:
        return self.label or self.name


class WindowClock:
    """The database clock of a measured window, read on one connection opened before the
    window (a connection opened inside it would be a session the window counts, and on
    Citus a coordinator backend more), and the wait for the producer's first item."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True, application_name="bench-clock")

    def now(self) -> Any:
        row = self.conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        return row[0]

    def produced(self, system: System) -> Any:
        """The newest item's key (:data:`bench.producer.PRODUCED`), None before the first."""
        row = self.conn.execute(PRODUCED[system.name]).fetchone()
        return row[0] if row else None

    def wait_for_first_item(self, system: System, before: Any, group: ProcessGroup, timeout: float = 120.0) -> None:
        """Until the producer has made an item (the newest key is no longer ``before``)."""
        wait_until(lambda: self.produced(system) != before, timeout=timeout, interval=0.05,
                   what=f"the {system.tag} producer's first item", group=group)

    def close(self) -> None:
        self.conn.close()


def _producer(system: System, group: ProcessGroup, url: str, workflow: str, *extra: str) -> Any:
    """The producer child; with ``--until-eof`` its input is a pipe, which
    :func:`~bench.procs.read_json_line` closes."""
    argv = ["-m", "bench.producer", system.name, "--url", url, "--workflow", workflow,
            "--threads", str(PRODUCER_THREADS), *extra]
    stdin = subprocess.PIPE if "--until-eof" in extra else subprocess.DEVNULL
    return group.spawn(argv, stdout=subprocess.PIPE, stdin=stdin)


def _stops_at_eof(root: Path) -> bool:
    """Whether the producer of the tree at ``root`` takes ``--until-eof`` (an older tree
    compared by :mod:`bench.ab` may not: its producer runs out its seconds)."""
    try:
        return "--until-eof" in (root / "bench" / "producer.py").read_text(encoding="utf-8")
    except OSError:
        return False


def drain(system: System, server: Server, template: str, *, workers: int, items: int,
          workflow: str = "one") -> dict[str, Any]:
    db = f"bench_{system.tag.replace('-', '_')}_drain_{workflow}_w{workers}"
    url = server.create_database(db, template=template)
    try:
        cpu = server_cpu(server, url)
        s0 = cpu.seconds()
        with ProcessGroup(f"{system.tag} producer", system.root) as producers:
            started = read_json_line(_producer(system, producers, url, workflow, "--count", str(items)),
                                     timeout=max(300.0, items / 5))
        s1 = cpu.seconds()
        server.checkpoint()
        poll = SessionPoll(url, system.unfinished_sql)
        try:
            with system.spawn(url, workers, system.root) as group:
                meter = Meter(cpu, group)
                meter.start()
                poll_s0 = poll.server_seconds()
                wait_until(lambda: poll.count() == 0, timeout=max(180.0, items / 5), interval=DRAIN_POLL_S,
                           what=f"{items} {system.tag} items to finish", group=group)
                meter.stop()
                poll_s = poll.server_seconds() - poll_s0
        finally:
            poll.close()
        claims = group.claim_counts()
        stats = unit_stats(url, system.units_sql)
        _, completed, last_run = system.runs_window(url, None)
        elapsed = seconds(stats.first_claim, last_run)
        return {
            "system": system.tag, "mode": "drain", "workflow": workflow, "workers": workers,
            "concurrency": system.concurrency, "runs": completed, "elapsed_s": elapsed,
            "runs_per_s": rate(completed, elapsed),
            "transitions_per_s": rate(2 * stats.finished, seconds(stats.first_claim, stats.last_finish)),
            "start_per_s": started["per_s"], "start_errors": started["errors"],
            "start_cpu": {"server_ms_per_item": per_item_ms(None if s0 is None or s1 is None else s1 - s0, items),
                          "processes_ms_per_item": per_item_ms(started["cpu_s"], items)},
            "cpu": meter.report(completed, bench_server_s=poll_s), "bench_polls": poll.polls,
            "units": stats.as_dict(), "claims": claims, "imports": _imports(producers, group),
        }
    finally:
        server.drop_database(db)


def sustained(system: System, server: Server, template: str, *, workers: int, duration: float,
              workflow: str = "one", warmup: float = 2.0, max_backlog: int | None = None,
              pace: float | None = None) -> dict[str, Any]:
    mode = "paced" if pace else "sustained"
    db = f"bench_{system.tag.replace('-', '_')}_{mode}_{workflow}_w{workers}"
    url = server.create_database(db, template=template)
    try:
        server.checkpoint()
        return sustained_on(system, url, workers=workers, duration=duration, workflow=workflow, warmup=warmup,
                            max_backlog=max_backlog, pace=pace, cpu=server_cpu(server, url))
    finally:
        server.drop_database(db)


def sustained_on(system: System, url: str, *, workers: int, duration: float, workflow: str = "one",
                 warmup: float = 2.0, max_backlog: int | None = None, pace: float | None = None,
                 cpu: ServerCPU | None = None) -> dict[str, Any]:
    """:func:`sustained` on an existing database: only what starts, is claimed and
    finishes inside the window counts, so rows already there (history) do not.
    ``cpu``: the server-side meter (default: the server behind ``url``)."""
    mode = "paced" if pace else "sustained"
    clock = WindowClock(url)
    try:
        with system.spawn(url, workers, system.root) as group:
            # The producer's seconds outlast the window (PRODUCER_SLACK_S); one that takes
            # --until-eof stops when the window ends instead, its input closed.
            extra = ["--seconds", str(warmup + duration + PRODUCER_SLACK_S)]
            if _stops_at_eof(system.root):
                extra.append("--until-eof")
            if pace:
                extra += ["--rate", str(pace)]
            if max_backlog:
                extra += ["--max-backlog", str(max_backlog)]
            before = clock.produced(system)
            producer = _producer(system, group, url, workflow, *extra)
            meter = Meter(cpu or ServerCPU(url), group)
            clock.wait_for_first_item(system, before, group)
            time.sleep(warmup)
            meter.start()
            w0 = clock.now()
            time.sleep(duration)
            w1 = clock.now()
            meter.stop()
            group.check_alive()     # a worker that died in the window: no figures from it
            produced = read_json_line(producer, timeout=120)    # closes its input: --until-eof stops it
            time.sleep(min(2.0, duration / 4))   # let the window's in-flight items finish
    finally:
        clock.close()
    stats = unit_stats(url, system.units_sql, (w0, w1))
    created, completed, _ = system.runs_window(url, (w0, w1))
    window = seconds(w0, w1)
    return {
        "system": system.tag, "mode": mode, "workflow": workflow, "workers": workers,
        "concurrency": system.concurrency, "window_s": window,
        "runs_per_s": rate(completed, window),
        "transitions_per_s": rate(stats.claimed_in_window + stats.finished_in_window, window),
        "started_per_s": rate(created, window),
        "backlog_growth_per_s": rate(created - completed, window),
        "max_backlog": max_backlog, "target_rate": pace, "producer": produced,
        "cpu": meter.report(completed, bench_server_s=_window_share(produced, window)),
        "units": stats.as_dict(), "claims": group.claim_counts(), "imports": group.imports(),
    }


def _imports(*groups: ProcessGroup) -> dict[str, list[str]]:
    """Which ``composer_ops`` and ``sql/`` the groups' processes imported."""
    return {key: sorted({path for g in groups for path in g.imports()[key]}) for key in ("composer_ops", "migrations")}


def _window_share(produced: dict[str, Any], window: float) -> float:
    """The server CPU of the producer's backlog polls that fell in the measured window
    (it polls at an even rate through its whole run)."""
    cpu_s, elapsed = produced.get("backlog_server_cpu_s"), produced.get("elapsed_s")
    return cpu_s * min(1.0, window / elapsed) if cpu_s and elapsed else 0.0
