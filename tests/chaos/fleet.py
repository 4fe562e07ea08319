"""The processes under test: ``composer-ops worker`` and ``coordinator``, spawned,
SIGKILLed and replaced by the chaos driver, and the webhook receiver they post to."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from composer_ops.engine.webhooks import SIGNATURE_HEADER, verify

ROOT = Path(__file__).resolve().parents[2]
SECRET = "chaos-webhook-secret"


@dataclass
class Proc:
    kind: str                      # "worker" | "coordinator"
    popen: subprocess.Popen[bytes]
    log: Path
    started: float

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class Kill:
    at: float                      # time.time()
    kind: str
    pid: int


class Fleet:
    """Keeps ``workers`` + ``coordinators`` processes alive; kills on request."""

    def __init__(self, db_url: str, logdir: Path, *, workers: int, coordinators: int, concurrency: int) -> None:
        self.db_url, self.logdir = db_url, logdir
        self.want = {"worker": workers, "coordinator": coordinators}
        self.concurrency = concurrency
        self.procs: list[Proc] = []
        self.kills: list[Kill] = []
        self.crashes: list[tuple[Proc, int]] = []   # exited without being killed: (proc, return code)
        self.spawned = 0
        self._lock = threading.Lock()

    def spawn(self, kind: str) -> Proc:
        env = {**os.environ, "COMPOSER_DATABASE_URL": self.db_url, "PYTHONPATH": str(ROOT),
               "COMPOSER_LOG_LEVEL": "INFO", "COMPOSER_WEBHOOK_SECRET": SECRET,
               "COMPOSER_WEBHOOK_CONNECT_TIMEOUT_S": "1", "COMPOSER_WEBHOOK_TIMEOUT_S": "1",
               "COMPOSER_WEBHOOK_DEADLINE_S": "1.5",
               "CHAOS_CONCURRENCY": str(self.concurrency)}
        args = (["worker", "--app", "tests.chaos.app:make_worker"] if kind == "worker"
                else ["coordinator", "--interval", "0.1"])
        self.spawned += 1
        log = self.logdir / f"{kind}-{self.spawned:04d}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen([sys.executable, "-m", "composer_ops", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=out)
        proc = Proc(kind, popen, log, time.time())
        with self._lock:
            self.procs.append(proc)
        return proc

    def start(self) -> None:
        for kind, count in self.want.items():
            for _ in range(count):
                self.spawn(kind)

    def alive(self, kind: str) -> list[Proc]:
        with self._lock:
            return [p for p in self.procs if p.kind == kind and p.popen.poll() is None]

    def kill(self, proc: Proc) -> None:
        """SIGKILL one process and start its replacement at once."""
        with self._lock:
            self.procs.remove(proc)
        self.kills.append(Kill(time.time(), proc.kind, proc.pid))
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(10)
        self.spawn(proc.kind)

    def reap(self) -> None:
        """Replace processes that exited on their own (a finding: they should not)."""
        with self._lock:
            gone = [p for p in self.procs if p.popen.poll() is not None]
            for p in gone:
                self.procs.remove(p)
        for p in gone:
            self.crashes.append((p, int(p.popen.returncode)))
            self.spawn(p.kind)

    def stop(self) -> None:
        with self._lock:
            procs, self.procs = list(self.procs), []
        for p in procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.popen.wait(15)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)
            if p.popen.returncode not in (0, -signal.SIGTERM):
                self.crashes.append((p, int(p.popen.returncode)))

    def log_summary(self) -> dict[str, Any]:
        """Counts from the processes' logs: stale results, lost leases, tracebacks by last line."""
        stale: Counter[str] = Counter()
        lease_lost = retried = 0
        tracebacks: Counter[str] = Counter()
        for log in sorted(self.logdir.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if "dropped stale result" in line:
                    reason = line.split("): ", 1)[-1]
                    stale[re.sub(r"[0-9a-f-]{36}|\d[\d:. T+-]*|\S+:\d+:[0-9a-f]{4}", "#", reason)[:100]] += 1
                elif "lease lost for task" in line:
                    lease_lost += 1
                elif "transient database error" in line:
                    retried += 1
                elif line.startswith("Traceback"):
                    end = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith((" ", "Traceback"))),
                               None)
                    last = lines[end] if end is not None else "?"
                    tracebacks[re.sub(r"[0-9a-f-]{36}|\d+(\.\d+)?", "#", last)[:160]] += 1
        return {"stale": dict(stale), "lease_lost": lease_lost, "retried": retried, "tracebacks": dict(tracebacks)}


@dataclass
class Hook:
    """A webhook receiver on 127.0.0.1 that fails the first POST for about a tenth of
    the runs (so the relay's retry is exercised) and checks every signature."""

    fail_share: int = 10           # 1 in fail_share runs gets a 500 first
    received: dict[str, list[str]] = field(default_factory=dict)   # run_id -> statuses posted
    bad_signatures: int = 0
    posts: int = 0
    torn: int = 0                  # requests cut off by a killed coordinator

    def __post_init__(self) -> None:
        hook = self
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    payload = json.loads(body)
                except ValueError:             # the sender was SIGKILLed mid-request
                    with lock:
                        hook.torn += 1
                    return
                ok = verify(SECRET, body, self.headers.get(SIGNATURE_HEADER) or "")
                run_id = str(payload.get("run_id"))
                with lock:
                    hook.posts += 1
                    seen = hook.received.setdefault(run_id, [])
                    first = not seen and zlib.crc32(run_id.encode()) % hook.fail_share == 0
                    if not ok:
                        hook.bad_signatures += 1
                    if not first:
                        seen.append(str(payload.get("status")))
                    else:
                        seen.append("")            # the refused first attempt
                self.send_response(500 if first else 204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
