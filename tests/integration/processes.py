"""Real worker and coordinator processes for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


class Cluster:
    """Spawns ``composer-ops worker`` / ``coordinator`` processes against one database."""

    def __init__(self, db_url: str, *, coordinator_interval: float = 0.1) -> None:
        self.db_url = db_url
        self.interval = coordinator_interval
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []

    def _spawn(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        full_env = {**os.environ, "COMPOSER_DATABASE_URL": self.db_url, "PYTHONPATH": str(ROOT), **(env or {})}
        log = tempfile.TemporaryFile()
        self.logs.append(log)
        proc = subprocess.Popen([sys.executable, "-m", "composer_ops", *args], cwd=ROOT, env=full_env,
                                stdout=subprocess.DEVNULL, stderr=log)
        self.procs.append(proc)
        return proc

    def worker(self, concurrency: int = 4, *extra: str) -> subprocess.Popen[bytes]:
        return self._spawn("worker", "--app", "tests.e2e_app:make_worker", *extra,
                           env={"E2E_CONCURRENCY": str(concurrency)})

    def coordinator(self, *extra: str) -> subprocess.Popen[bytes]:
        return self._spawn("coordinator", "--interval", str(self.interval), *extra)

    def stderr(self, proc: subprocess.Popen[bytes]) -> str:
        """What ``proc`` wrote to stderr so far."""
        log = self.logs[self.procs.index(proc)]
        log.seek(0)
        text: str = log.read().decode(errors="replace")
        log.seek(0, os.SEEK_END)
        return text

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for log in self.logs:
            log.seek(0)
            text = log.read().decode(errors="replace").strip()
            if "Traceback" in text:
                sys.stderr.write(f"--- process log ---\n{text[-4000:]}\n")
            log.close()


@contextmanager
def cluster(db_url: str, *, workers: int = 1, coordinators: int = 1, concurrency: int = 4) -> Iterator[Cluster]:
    c = Cluster(db_url)
    try:
        for _ in range(workers):
            c.worker(concurrency)
        for _ in range(coordinators):
            c.coordinator()
        yield c
    finally:
        c.close()


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)
