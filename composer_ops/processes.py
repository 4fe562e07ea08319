"""Real ``composer-ops worker`` and ``coordinator`` processes against one database.

A :class:`Fleet` spawns them (each logging to its own file), SIGKILLs and replaces them,
notices the ones that exit on their own, and stops them all at the end, printing the
tail of any log holding a traceback::

    with Fleet(db_url, app="myapp.workers:worker") as fleet:
        fleet.worker(concurrency=2)
        fleet.coordinator()

The simulator's live traffic and the test suite use it; ``command`` runs either this
interpreter's ``-m composer_ops`` or an installed ``composer-ops``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from composer_ops.engine.worker_options import DEFAULT_SHUTDOWN_TIMEOUT_S

Kind = Literal["worker", "coordinator"]
#: How long :meth:`Fleet.terminate` waits after SIGTERM: the processes' own shutdown
#: timeout (they wait that long for running handlers) and time to close connections.
STOP_TIMEOUT_S = DEFAULT_SHUTDOWN_TIMEOUT_S + 15.0


@dataclass
class Proc:
    """One spawned process: its kind, the arguments after the command name, its log,
    its name (the log's name) and the variables it got on top of the fleet's."""

    kind: Kind
    args: tuple[str, ...]
    popen: subprocess.Popen[bytes]
    log: Path
    started: float                 # time.time()
    name: str = ""
    env: Mapping[str, str] = field(default_factory=dict)

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
    """Worker and coordinator processes against ``db_url``; workers serve ``app``
    (``module:callable``, as ``composer-ops worker --app`` takes it).

    ``env`` is the processes' environment (this process's by default), with
    ``COMPOSER_DATABASE_URL`` set to ``db_url``; ``logdir`` keeps the logs (else they live
    in a temporary directory removed by :meth:`stop`); ``cwd`` is where the processes
    run (this process's working directory by default).
    """

    def __init__(self, db_url: str, *, app: str, coordinator_interval: float = 0.1,
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

    def worker(self, *args: str, concurrency: int = 4, env: Mapping[str, str] | None = None,
               name: str | None = None) -> Proc:
        """``composer-ops worker --app APP --concurrency N ARGS``."""
        return self.spawn("worker", "--app", self.app, "--concurrency", str(concurrency), *args, env=env, name=name)

    def coordinator(self, *args: str, env: Mapping[str, str] | None = None, name: str | None = None) -> Proc:
        """``composer-ops coordinator --interval I ARGS``."""
        return self.spawn("coordinator", "--interval", str(self.interval), *args, env=env, name=name)

    def spawn(self, kind: Kind, *args: str, env: Mapping[str, str] | None = None, name: str | None = None) -> Proc:
        """``composer-ops KIND ARGS`` with ``env`` on top of the fleet's variables, its
        stderr in ``logdir/NAME.log`` (``KIND-NNNN`` unless named)."""
        with self._lock:
            self.spawned += 1
            name = name or f"{kind}-{self.spawned:04d}"
        log = self.logdir / f"{name}.log"
        extra = dict(env or {})
        with open(log, "wb") as out:
            popen = subprocess.Popen([*self.command, kind, *args], cwd=self.cwd, env={**self.env, **extra},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out)
        proc = Proc(kind, args, popen, log, time.time(), name, extra)
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
        return self.spawn(proc.kind, *proc.args, env=proc.env) if replace else None

    def exited(self) -> list[Proc]:
        """Take out the processes that exited on their own, recording them in ``crashes``."""
        with self._lock:
            gone = [p for p in self.procs if not p.alive()]
            for p in gone:
                self.procs.remove(p)
        for p in gone:
            self.crashes.append((p, int(p.popen.returncode)))
        return gone

    def reap(self) -> list[Proc]:
        """Replace the processes that exited on their own (recorded in ``crashes``);
        returns the replacements."""
        return [self.spawn(p.kind, *p.args, env=p.env) for p in self.exited()]

    def terminate(self, kind: Kind | None = None, timeout: float = STOP_TIMEOUT_S) -> list[Proc]:
        """SIGTERM the processes (of ``kind``, else all); one still running after
        ``timeout`` is sent SIGUSR1 (its threads' stacks go to its log) and then SIGKILL.
        An exit other than a clean one (0, or death by the SIGTERM) is recorded in
        ``crashes``. Returns the processes it stopped."""
        with self._lock:
            procs = [p for p in self.procs if kind is None or p.kind == kind]
            self.procs = [p for p in self.procs if p not in procs]
        for p in procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.send_signal(signal.SIGUSR1)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(1)
                p.popen.kill()
                p.popen.wait(5)
            if p.popen.returncode not in (0, -signal.SIGTERM):
                self.crashes.append((p, int(p.popen.returncode)))
        return procs

    def stop(self, timeout: float = STOP_TIMEOUT_S, *, keep_logs: bool = False) -> None:
        """:meth:`terminate` every process, print the tail of up to three logs that hold a
        traceback, and delete the fleet's own log directory unless ``keep_logs``."""
        procs = self.terminate(None, timeout)
        shown = 0
        for p in procs:
            text = p.stderr().strip()
            if "Traceback" in text and shown < 3:
                shown += 1
                sys.stderr.write(f"--- {p.kind} pid {p.pid} log ({p.log.name}) ---\n{text[-2000:]}\n")
        if self._own_logdir and not keep_logs:
            shutil.rmtree(self.logdir, ignore_errors=True)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

