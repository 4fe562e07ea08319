"""Load producers: start Composer runs or defer Procrastinate jobs from N threads.

The same loop drives both systems, so the only difference between the two sides is
the call each thread makes: ``engine.start(workflow)`` (one transaction: run row,
root task, outbox row, NOTIFY) or ``task.defer()`` (one transaction: job row, event
row, NOTIFY). Either for ``--count`` items (pre-filling a queue to drain) or for
``--seconds`` (producing while workers consume), optionally paced at ``--rate``/s
or held to at most ``--max-backlog`` unfinished items. With ``--until-eof`` it also
stops when its standard input is closed: the benchmark closes it when its measured
window ends, instead of waiting out a producer timed to outlast the window.

Run as ``python -m bench.producer {composer,procrastinate,floor} --url URL ...``; prints
one JSON line with what it did (the floor: :mod:`bench.floor`'s plain statements).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: The sustained producer reads its backlog about this many times while the workers
#: finish a backlog's worth of items, between ``BACKLOG_POLL_S``: often enough that
#: the workers never run dry (a fifth of the backlog at most is finished between two
#: reads), and no oftener. The count reads every shard of a Citus cluster: read every
#: 10 ms whatever the rate, it alone took most of a core there.
BACKLOG_READS_PER_TURNOVER = 5
BACKLOG_POLL_S = (0.01, 0.1)


class Backlog:
    """Keeps the number of unfinished items at most ``limit``: a thread counts them on
    one connection (:class:`bench.cpu.SessionPoll`, whose server CPU is reported
    apart), :data:`BACKLOG_READS_PER_TURNOVER` times per ``limit`` finished;
    producers wait while the last count plus what they submitted since would reach the
    limit. A bounded backlog makes "sustained" mean what it says: items start no
    faster than the workers finish them."""

    def __init__(self, url: str, query: str, limit: int) -> None:
        self.url, self.query, self.limit = url, query, limit
        self._lock = threading.Lock()
        self._count = 0
        self._since = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.polls = 0
        self.server_cpu_s = 0.0

    def __enter__(self) -> Backlog:
        from bench.cpu import SessionPoll

        self._session = SessionPoll(self.url, self.query, application_name="bench-backlog")
        self._refresh()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.polls, self.server_cpu_s = self._session.polls, self._session.server_seconds()
        self._session.close()

    def _refresh(self) -> int:
        """Read the count; returns the items finished since the last read."""
        value = self._session.count()
        with self._lock:
            finished = self._count + self._since - value
            self._count = value
            self._since = 0
        return max(0, finished)

    def _poll(self) -> None:
        shortest, longest = BACKLOG_POLL_S
        interval, last = shortest, time.monotonic()
        while not self._stop.wait(interval):
            finished = self._refresh()
            now = time.monotonic()
            rate = finished / max(now - last, 1e-3)
            last = now
            turnover = self.limit / rate if rate > 0 else longest * BACKLOG_READS_PER_TURNOVER
            interval = min(longest, max(shortest, turnover / BACKLOG_READS_PER_TURNOVER))

    def acquire(self, over: Callable[[], bool]) -> bool:
        """Wait for room; False if the producer's time was ``over`` first."""
        while not over():
            with self._lock:
                if self._count + self._since < self.limit:
                    self._since += 1
                    return True
            time.sleep(0.002)
        return False


def produce(submit: Callable[[], Any], *, threads: int, count: int | None = None,
            seconds: float | None = None, rate: float | None = None,
            backlog: Backlog | None = None, stop: threading.Event | None = None) -> dict[str, Any]:
    """Call ``submit`` from ``threads`` threads until ``count`` calls or ``seconds``
    elapse, or ``stop`` is set; with ``rate``, call number i is not made before
    ``start + i / rate``; with ``backlog``, never with more than its limit of
    unfinished items."""
    if count is None and seconds is None:
        raise ValueError("give count or seconds")
    ticket = itertools.count()
    lock = threading.Lock()
    done = 0
    errors: list[str] = []
    cpu0 = time.process_time()
    start = time.monotonic()
    deadline = start + seconds if seconds is not None else float("inf")

    halt = stop or threading.Event()

    def over() -> bool:
        return time.monotonic() >= deadline or halt.is_set()

    def loop() -> None:
        nonlocal done
        while True:
            with lock:
                i = next(ticket)
            if count is not None and i >= count:
                return
            if rate:
                delay = start + i / rate - time.monotonic()
                if delay > 0 and halt.wait(delay):
                    return
            if backlog is not None and not backlog.acquire(over):
                return
            if over():
                return
            try:
                submit()
            except Exception as exc:  # a failed start is counted and reported, not fatal
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                done += 1

    pool = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.monotonic() - start
    return {"submitted": done, "errors": len(errors), "first_error": errors[0] if errors else None,
            "elapsed_s": elapsed, "per_s": done / elapsed if elapsed > 0 else 0.0,
            "cpu_s": time.process_time() - cpu0}


#: Unfinished items, counted every 10 ms through an index on each side (the device's
#: own cost is in the server CPU of both). A Composer run is unfinished while it has
#: an active task: both change in the same transactions. (Counting workflow_runs by
#: status reads every run row: no index holds the status, and that count cost
#: Composer twice the server CPU it cost Procrastinate, 0.14 against 0.07 ms per run.)
UNFINISHED = {
    "composer": "SELECT count(DISTINCT run_id) FROM task_instances "
                "WHERE state IN ('PENDING', 'RUNNING', 'QUEUED', 'WAITING')",
    "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')",
}
#: The floor (:mod:`bench.floor`) writes Composer's rows.
UNFINISHED["floor"] = UNFINISHED["composer"]


#: The newest item's key on each side (the benchmark's window waits for it to change:
#: the producer's first item, :class:`bench.scenario.WindowClock`); through the primary
#: keys' indexes, rows already there (history) included.
PRODUCED = {
    "composer": "SELECT max(id) FROM workflow_runs",
    "procrastinate": "SELECT max(id) FROM procrastinate_jobs",
}
PRODUCED["floor"] = PRODUCED["composer"]


def composer_submitter(url: str, workflow: str, threads: int) -> tuple[Callable[[], Any], Callable[[], None]]:
    from composer_ops import Engine

    engine = Engine.connect(url, pool_size=threads, application_name="bench-producer")
    return (lambda: engine.start(workflow)), engine.close


def procrastinate_submitter(url: str, threads: int) -> tuple[Callable[[], Any], Callable[[], None]]:
    from bench.peer_procrastinate import make_app

    app = make_app(url, pool_size=threads, application_name="bench-producer")
    app.open()
    task = app.tasks["noop"]
    return (lambda: task.defer()), app.close


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.producer")
    parser.add_argument("system", choices=["composer", "procrastinate", "floor"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--workflow", default="one", help="one, fan, or a deployed workflow id")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--count", type=int)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--rate", type=float)
    parser.add_argument("--max-backlog", type=int, help="never more than this many unfinished items")
    parser.add_argument("--until-eof", action="store_true",
                        help="also stop when standard input is closed (the caller's window ended)")
    args = parser.parse_args()
    stop = threading.Event()
    if args.until_eof:
        def wait_for_eof() -> None:
            # The descriptor, not sys.stdin: a daemon thread blocked in a buffered read holds
            # the buffer's lock, and the interpreter's exit can abort on it ("could not
            # acquire lock for <_io.BufferedReader name='<stdin>'>") when the producer ends
            # on its seconds first.
            if sys.stdin is not None:
                while os.read(sys.stdin.fileno(), 65536):
                    pass
            stop.set()

        threading.Thread(target=wait_for_eof, daemon=True).start()
    if args.system == "composer":
        from bench.workload import WORKFLOWS

        workflow = WORKFLOWS[args.workflow]["id"] if args.workflow in WORKFLOWS else args.workflow
        submit, close = composer_submitter(args.url, workflow, args.threads)
    elif args.system == "floor":
        from bench.floor import submitter

        if args.workflow != "one":
            parser.error(f"the floor starts 1-task runs only (--workflow one), got --workflow {args.workflow}")
        submit, close = submitter(args.url)
    else:
        submit, close = procrastinate_submitter(args.url, args.threads)
    try:
        if args.max_backlog:
            with Backlog(args.url, UNFINISHED[args.system], args.max_backlog) as backlog:
                result = produce(submit, threads=args.threads, count=args.count, seconds=args.seconds,
                                 rate=args.rate, backlog=backlog, stop=stop)
            result.update(backlog_polls=backlog.polls, backlog_server_cpu_s=backlog.server_cpu_s)
        else:
            result = produce(submit, threads=args.threads, count=args.count, seconds=args.seconds, rate=args.rate,
                             stop=stop)
    finally:
        close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
