"""Real ``composer-ops worker`` and ``coordinator`` processes against one database.

A :class:`Fleet` spawns them (each with its stderr in a log file of its own), SIGKILLs
and replaces them, notices the ones that exit on their own, and stops them all
(SIGTERM, then SIGKILL) at the end, printing the tail of any log that holds a
traceback. ::

    with Fleet(db_url) as fleet:
        fleet.worker(concurrency=2)
        fleet.coordinator()
        run_id = engine.start("wf")
        wait_for(lambda: engine.get_run(run_id).status == "SUCCEEDED", what="the run")

Workers serve :mod:`composer_ops.testing.app` unless told otherwise. ``command``
chooses how ``composer-ops`` is started (this interpreter's ``-m composer_ops`` by
default, or an installed ``composer-ops`` script), so the same fleet drives a source
tree and an installed package alike.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["worker", "coordinator"]

APP = "composer_ops.testing.app:make_worker"
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


@dataclass
class Proc:
    """One spawned process: its kind, the arguments after the command name, its log."""

    kind: Kind
    args: tuple[str, ...]
    popen: subprocess.Popen[bytes]
    log: Path
    started: float                 # time.time()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stderr(self) -> str:
        """What the process wrote to stderr so far."""
        return self.log.read_text(errors="replace")


@dataclass(frozen=True)
class Kill:
    at: float                      # time.time()
    kind: Kind
    pid: int


class Fleet:
    """Worker and coordinator processes against ``db_url``.

    ``env`` is the processes' environment (this process's by default), with
    ``COMPOSER_DATABASE_URL`` set to ``db_url``; ``logdir`` keeps the logs (else they live
    in a temporary directory removed by :meth:`stop`); ``cwd`` is where the processes
    run (this process's working directory by default).
    """

    def __init__(self, db_url: str, *, app: str = APP, coordinator_interval: float = 0.1,
                 env: Mapping[str, str] | None = None, logdir: Path | None = None, cwd: Path | None = None,
                 command: Sequence[str] = (sys.executable, "-m", "composer_ops")) -> None:
        self.db_url, self.app, self.interval = db_url, app, coordinator_interval
        self.env = {**(os.environ if env is None else env), "COMPOSER_DATABASE_URL": db_url}
        self.command, self.cwd = list(command), cwd
        self._own_logdir = logdir is None
        self.logdir = logdir if logdir is not None else Path(tempfile.mkdtemp(prefix="composer-fleet-"))
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.kills: list[Kill] = []
        self.crashes: list[tuple[Proc, int]] = []   # exited without being told to: (proc, return code)
        self.spawned = 0
        self._lock = threading.Lock()

    def worker(self, *args: str, concurrency: int = 4) -> Proc:
        """``composer-ops worker --app APP --concurrency N ARGS``."""
        return self.spawn("worker", "--app", self.app, "--concurrency", str(concurrency), *args)

    def coordinator(self, *args: str) -> Proc:
        """``composer-ops coordinator --interval I ARGS``."""
        return self.spawn("coordinator", "--interval", str(self.interval), *args)

    def spawn(self, kind: Kind, *args: str) -> Proc:
        """``composer-ops KIND ARGS``, its stderr in ``logdir/KIND-NNNN.log``."""
        with self._lock:
            self.spawned += 1
            log = self.logdir / f"{kind}-{self.spawned:04d}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen([*self.command, kind, *args], cwd=self.cwd, env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out)
        proc = Proc(kind, args, popen, log, time.time())
        with self._lock:
            self.procs.append(proc)
        return proc

    def alive(self, kind: Kind | None = None) -> list[Proc]:
        with self._lock:
            return [p for p in self.procs if (kind is None or p.kind == kind) and p.alive()]

    def kill(self, proc: Proc, *, replace: bool = False) -> Proc | None:
        """SIGKILL ``proc``; with ``replace``, start one like it at once and return it."""
        with self._lock:
            self.procs.remove(proc)
        self.kills.append(Kill(time.time(), proc.kind, proc.pid))
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(10)
        return self.spawn(proc.kind, *proc.args) if replace else None

    def reap(self) -> list[Proc]:
        """Replace the processes that exited on their own (recorded in ``crashes``);
        returns the replacements."""
        with self._lock:
            gone = [p for p in self.procs if not p.alive()]
            for p in gone:
                self.procs.remove(p)
        for p in gone:
            self.crashes.append((p, int(p.popen.returncode)))
        return [self.spawn(p.kind, *p.args) for p in gone]

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every process, SIGKILL those still running after ``timeout``; an exit
        other than a clean one (0, or death by the SIGTERM) is recorded in ``crashes``."""
        with self._lock:
            procs, self.procs = list(self.procs), []
        for p in procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)
            if p.popen.returncode not in (0, -signal.SIGTERM):
                self.crashes.append((p, int(p.popen.returncode)))
        shown = 0
        for p in procs:
            text = p.stderr().strip()
            if "Traceback" in text and shown < 3:
                shown += 1
                sys.stderr.write(f"--- {p.kind} pid {p.pid} log ({p.log.name}) ---\n{text[-2000:]}\n")
        if self._own_logdir:
            shutil.rmtree(self.logdir, ignore_errors=True)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something true, and return that; raise
    AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)
