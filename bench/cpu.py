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

from bench.procs import ProcessGroup, scalar
from composer_ops.testing.servers import Server


class ServerCPU:
    """The CPU of the server behind ``url``, and of the servers behind ``more_urls``."""

    def __init__(self, url: str, *more_urls: str) -> None:
        self.postmasters: list[psutil.Process | None] = [_postmaster(u) for u in (url, *more_urls)]

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
    return ServerCPU(*nodes) if nodes else ServerCPU(url)


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

    def start(self) -> None:
        self._s0, self._g0 = self.server.seconds(), group_seconds(self.group)

    def stop(self) -> None:
        s1 = self.server.seconds()
        self.server_s = s1 - self._s0 if s1 is not None and self._s0 is not None else None
        self.group_s = group_seconds(self.group) - self._g0

    def report(self, items: int, extra_client_s: float = 0.0) -> dict[str, Any]:
        return {"server_ms_per_item": per_item_ms(self.server_s, items),
                "processes_ms_per_item": per_item_ms(self.group_s + extra_client_s, items)}
