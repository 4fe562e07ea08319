"""Child processes of the benchmark: workers, coordinators, load producers.

Each child's stderr goes to a temporary file; if a child dies or leaves a traceback
its tail is printed, so a broken benchmark never reports numbers silently.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import psycopg

from bench import sides

ROOT = Path(__file__).resolve().parents[1]


class ProcessGroup:
    """Processes started together and stopped together (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, root: Path = ROOT) -> None:
        self.name = name
        self.root = root        # the source tree the children import (bench.ab compares two)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        #: where the workers append their claim counts at exit (bench.workload sets it);
        #: read and removed by stop()
        self.claim_log: Path | None = None
        self._claims: dict[str, Any] | None = None
        fd, log = tempfile.mkstemp(prefix="bench-imports-", suffix=".jsonl")
        os.close(fd)
        self._import_log = Path(log)
        self._imports: list[dict[str, Any]] = []

    def spawn(self, argv: Sequence[str], env: dict[str, str] | None = None,
              stdout: int | None = subprocess.DEVNULL,
              stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        """Start ``python -m MODULE ...`` (``argv``) from the group's tree, through
        :data:`bench.sides.BOOT`: it imports that tree's code and ``sql/``."""
        full_env = sides.env(self.root, {**(env or {}), "BENCH_IMPORT_LOG": str(self._import_log)})
        log = tempfile.TemporaryFile()
        self._logs.append(log)
        proc = subprocess.Popen(sides.argv(*argv), cwd=self.root, env=full_env, stdin=stdin, stdout=stdout,
                                stderr=log)
        self.procs.append(proc)
        return proc

    def count_claims(self) -> dict[str, str]:
        """Make the file the group's workers append their claim counts to at exit (one
        JSON line each: claims, empty, tasks, by_reason), read by :meth:`stop` into
        :meth:`claim_counts`; returns the environment that names it to them."""
        fd, log = tempfile.mkstemp(prefix="bench-claims-", suffix=".jsonl")
        os.close(fd)
        self.claim_log = Path(log)
        return {"BENCH_CLAIM_LOG": log}

    def check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"{self.name}: {proc.args!r} exited with {proc.returncode}\n{self.tail()}")

    def tail(self, limit: int = 3000) -> str:
        out = []
        for log in self._logs:
            log.seek(0)
            text = log.read().decode(errors="replace").strip()
            if text:
                out.append(text[-limit:])
        return "\n---\n".join(out)

    def stop(self, timeout: float = 15.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._read_claims()
        self._imports += sides.read_imports(self._import_log)
        text = self.tail()
        if "Traceback" in text:
            sys.stderr.write(f"--- {self.name}: child process log ---\n{text}\n")
        for log in self._logs:
            log.close()
        self.procs.clear()
        self._logs.clear()

    def imports(self) -> dict[str, list[str]]:
        """Which ``composer_ops`` and ``sql/`` the group's processes imported (known
        once the group has stopped)."""
        return sides.imported(self._imports)

    def claim_counts(self) -> dict[str, Any] | None:
        """Claims the group's workers made and how many came back empty, summed over
        its worker processes (known once the group has stopped)."""
        return self._claims

    def _read_claims(self) -> None:
        if self.claim_log is None or not self.claim_log.exists():
            return
        total = {"processes": 0, "claims": 0, "empty": 0, "tasks": 0}
        by_reason: dict[str, dict[str, int]] = {}
        for line in self.claim_log.read_text().splitlines():
            if line.strip():
                counts = json.loads(line)
                total["processes"] += 1
                for key in ("claims", "empty", "tasks"):
                    total[key] += int(counts[key])
                for reason, n in (counts.get("by_reason") or {}).items():
                    into = by_reason.setdefault(reason, {"claims": 0, "empty": 0})
                    into["claims"] += int(n["claims"])
                    into["empty"] += int(n["empty"])
        share = total["empty"] / total["claims"] if total["claims"] else None
        # each reason's empty claims as a share of all claims: the shares add up to empty_share
        empty_share_by_reason = {reason: n["empty"] / total["claims"] for reason, n in by_reason.items()
                                 if total["claims"]}
        self._claims = {**total, "empty_share": share, "by_reason": by_reason,
                        "empty_share_by_reason": empty_share_by_reason}
        self.claim_log.unlink()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_until(predicate: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.1,
               group: ProcessGroup | None = None) -> float:
    """Poll ``predicate`` until true; returns the seconds waited, raises on timeout."""
    start = time.monotonic()
    while not predicate():
        if group is not None:
            group.check_alive()
        if time.monotonic() - start > timeout:
            tail = f"\n{group.tail()}" if group is not None else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
        time.sleep(interval)
    return time.monotonic() - start


def scalar(url: str, query: str, params: Any = None) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def db_now(url: str) -> Any:
    """The database clock: every timestamp the benchmark compares is read from it."""
    return scalar(url, "SELECT clock_timestamp()")


def connections(url: str, application_name: str) -> int:
    """How many sessions of ``application_name`` are connected to this URL's database."""
    return int(scalar(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND application_name = %s", (application_name,)))


def read_json_line(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """Wait for a producer child and parse the one JSON line it printed. Its standard
    input, a pipe, is closed first (``communicate`` does): a producer run with
    ``--until-eof`` stops then."""
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"producer {proc.args!r} exited with {proc.returncode}")
    lines = [ln for ln in out.decode().splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise RuntimeError(f"producer {proc.args!r} printed no result")
    result: dict[str, Any] = json.loads(lines[-1])
    return result
