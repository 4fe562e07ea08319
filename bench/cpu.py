"""CPU seconds spent by the server and by the benchmark's own child processes.

Throughput on a shared 2-core machine moves with whatever else runs; CPU time per
run moves much less, so it is reported next to every rate. Server CPU is the
postmaster and all its children, live ones plus the reaped ones the kernel credits
to the postmaster; it is only available when the server runs on this machine. For a
server of several nodes (a Citus cluster, :mod:`bench.citus`) it is every node's.
"""

from __future__ import annotations

from typing import Any

import psutil
import psycopg

from bench.procs import ProcessGroup, scalar
from composer_ops.testing.servers import Server


class DbCounters:
    """Counters of one database over a measurement, on every node of its server:
    sessions opened (``pg_stat_database.sessions``: a backend reports its own at the
    end of its first transaction) and, on Citus, two-phase
    commits (``pg_dist_transaction``: one row per worker group a transaction prepared
    on, kept while ``citus.recover_2pc_interval = -1``; the distributed transactions
    are counted by the transaction number in the row's name). Its connections are
    opened when it is made, so they are counted before a measurement, never during."""

    def __init__(self, url: str, node_admin_urls: tuple[str, ...]) -> None:
        self.db = str(psycopg.conninfo.conninfo_to_dict(url).get("dbname"))
        self.nodes = [psycopg.connect(u, autocommit=True, application_name="bench-counters")
                      for u in node_admin_urls]
        self.conn = psycopg.connect(url, autocommit=True, application_name="bench-counters")
        row = self.conn.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')").fetchone()
        self.citus = bool(row and row[0])

    def read(self) -> dict[str, int]:
        sessions = 0
        for node in self.nodes:
            node.execute("SELECT pg_stat_clear_snapshot()")
            row = node.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", (self.db,)).fetchone()
            sessions += int(row[0]) if row and row[0] is not None else 0
        out = {"sessions": sessions}
        if self.citus:
            row = self.conn.execute(
                r"""SELECT count(DISTINCT substring(gid from '^citus_\d+_\d+_\d+')) FROM pg_dist_transaction""",
            ).fetchone()
            out["two_phase_commits"] = int(row[0]) if row else 0
        return out

    def close(self) -> None:
        for conn in (*self.nodes, self.conn):
            conn.close()


class ServerCPU:
    """The CPU of the server behind ``url``, and of the servers behind ``more_urls``;
    ``counters``, when given, are read with it by :class:`Meter`."""

    def __init__(self, url: str, *more_urls: str, counters: DbCounters | None = None) -> None:
        self.postmasters: list[psutil.Process | None] = [_postmaster(u) for u in (url, *more_urls)]
        self.counters = counters

    def seconds(self) -> float | None:
        total = 0.0
        for postmaster in self.postmasters:
            if postmaster is None:
                return None
            try:
                own = postmaster.cpu_times()
                total += own.user + own.system + own.children_user + own.children_system
                for child in postmaster.children():
                    try:
                        t = child.cpu_times()
                        total += t.user + t.system
                    except psutil.Error:
                        pass   # exited between listing and reading: credited to children_* next time
            except psutil.Error:
                return None
        return total


def _postmaster(url: str) -> psutil.Process | None:
    try:
        # The checkpointer lives as long as the server; its parent is the postmaster.
        pid = scalar(url, "SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'")
        parent = psutil.Process(int(pid)).parent() if pid else None
        if parent is not None and "postgres" in " ".join(parent.cmdline() or [parent.name()]):
            return parent
    except (psutil.Error, OSError, ValueError):
        pass
    return None


def server_cpu(server: Server, url: str) -> ServerCPU:
    """The server-side CPU meter of a measurement on ``url``: every node's when
    ``server`` has several (``node_urls``, :class:`bench.citus.ClusterTarget`)."""
    nodes: tuple[str, ...] = getattr(server, "node_urls", ())
    counters = DbCounters(url, nodes or (server.admin_url,))
    return ServerCPU(*nodes, counters=counters) if nodes else ServerCPU(url, counters=counters)


def group_seconds(group: ProcessGroup) -> float:
    total = 0.0
    for proc in group.procs:
        try:
            t = psutil.Process(proc.pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def per_item_ms(seconds: float | None, items: int) -> float | None:
    if seconds is None or items <= 0:
        return None
    return seconds / items * 1000


class Meter:
    """CPU of the server and of a process group between ``start()`` and ``stop()``."""

    def __init__(self, server: ServerCPU, group: ProcessGroup) -> None:
        self.server, self.group = server, group
        self._s0: float | None = None
        self._g0 = 0.0
        self.server_s: float | None = None
        self.group_s = 0.0
        self._c0: dict[str, int] = {}
        self.counts: dict[str, int] = {}

    def start(self) -> None:
        self._c0 = self.server.counters.read() if self.server.counters else {}
        self._s0, self._g0 = self.server.seconds(), group_seconds(self.group)

    def stop(self) -> None:
        s1 = self.server.seconds()
        self.server_s = s1 - self._s0 if s1 is not None and self._s0 is not None else None
        self.group_s = group_seconds(self.group) - self._g0
        if self.server.counters:
            c1 = self.server.counters.read()
            self.counts = {k: c1[k] - v for k, v in self._c0.items()}
            self.server.counters.close()

    def report(self, items: int, extra_client_s: float = 0.0, bench_server_s: float = 0.0) -> dict[str, Any]:
        """CPU per item: the server's (every node's), the engine's processes', and the
        server CPU of the benchmark's own polling (``bench_server_s``), which is taken
        out of the server's figure and reported apart."""
        server_s = None if self.server_s is None else self.server_s - bench_server_s
        return {"server_ms_per_item": per_item_ms(server_s, items),
                "processes_ms_per_item": per_item_ms(self.group_s + extra_client_s, items),
                "bench_poll_server_ms_per_item": per_item_ms(bench_server_s, items),
                **{f"{k}_per_item": v / items if items > 0 else None for k, v in self.counts.items()}}


class SessionPoll:
    """The benchmark's own polling of one measurement: a query run on one connection,
    opened once (on Citus, its worker connections are cached for the session), with
    the server CPU it costs read from its backends: the session's own and, on Citus,
    the backends the worker nodes serve it with (the same global PID), found when it is
    opened. That CPU is reported apart from the engine's; every node runs on this
    machine, so each backend is a process here."""

    def __init__(self, url: str, query: str, *, application_name: str = "bench-poll") -> None:
        self.query = query
        self.conn = psycopg.connect(url, autocommit=True, application_name=application_name)
        # A fresh database has no statistics yet: without this the planner reads the
        # whole table instead of the index the count is written for.
        self.conn.execute("SET enable_seqscan = off")
        # One count now, before any window: on Citus it opens (and caches) the session's
        # connections to the worker nodes, whose backends are then found once, here.
        # citus_stat_activity connects to every node, so it is not read inside a window.
        self.polls = 0
        self.count()
        self.polls = 0
        self._pids_seen = self._pids()
        self._cpu0 = self._cpu()

    def count(self) -> int:
        row = self.conn.execute(self.query).fetchone()
        self.polls += 1
        return int(row[0]) if row else 0

    def _pids(self) -> list[int]:
        on_citus = self.conn.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')").fetchone()
        if on_citus and on_citus[0]:
            rows = self.conn.execute("SELECT pid FROM citus_stat_activity WHERE global_pid = citus_backend_gpid()"
                                     " AND pid IS NOT NULL").fetchall()
            return sorted({int(r[0]) for r in rows} | {self.conn.info.backend_pid})
        return [self.conn.info.backend_pid]

    def _cpu(self) -> float:
        total = 0.0
        for pid in self._pids_seen:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass    # a worker connection closed meanwhile: its CPU is lost to this count
        return total

    def server_seconds(self) -> float:
        """Server CPU the polls cost since this poll was opened."""
        return self._cpu() - self._cpu0

    def close(self) -> None:
        self.conn.close()
