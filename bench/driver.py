"""What one statement costs the client's Python, by the psycopg call it goes through.

``python -m bench.driver [--pgbin DIR] [--statements 5000] [--rounds 3] [--out FILE]``

A design measurement of the driver, not of the engine: the same prepared statement (an
indexed read of one row of a small table) sent ``--statements`` times in a row from one
thread, each of these ways, alternating which goes first by round:

- ``cursor``: ``Cursor.execute`` with ``%s`` placeholders, prepared (most of the
  engine's statements, through its error boundary's wrappers: composer_ops/db/errors.py,
  one more layer, not measured here);
- ``raw cursor``: ``RawCursor.execute`` with ``$n`` placeholders (an event's one write,
  composer_ops/repo/writes.py);
- ``raw cursor, pipeline``: the same inside a ``Connection.pipeline()`` block of its own
  (a start sends its statement so; a completion's two round trips are two such blocks of
  two or three statements);
- ``libpq``: ``PGconn.exec_prepared`` of psycopg's ``pq`` module, blocking, the value
  read from the result: no cursor, adaptation or wait loop. The floor of what a
  statement's round trip costs in Python here, not a way the engine could send one as
  it is (it neither waits without blocking nor adapts values).

Each is measured as this process's CPU time (``time.process_time``) and the session
backend's (``/proc/PID/schedstat``; None on a server whose processes this machine cannot
read, such as ``COMPOSER_DATABASE_URL``'s) per statement. Prints the medians per way and
writes them as JSON, with psycopg's version and build and libpq's version, to ``--out``
(default ``bench/results/driver-pg<major>-<date>-<commit>.json``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from rich.table import Table

from bench import scenario
from bench.flowcost import OnCpu
from bench.measure import median
from bench.report import measured_run, parser, publish, require_binaries, stderr_log
from composer_ops.testing import servers

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ROWS = 1000
WAYS = ("cursor", "raw cursor", "raw cursor, pipeline", "libpq")


def _ways(conn: psycopg.Connection[Any]) -> dict[str, Callable[[int], Any]]:
    cur = conn.cursor()
    raw = psycopg.RawCursor(conn)
    pgconn = conn.pgconn
    pgconn.prepare(b"bench_driver_read", b"SELECT v FROM bench_driver WHERE id = $1", [23])

    def by_cursor(i: int) -> Any:
        cur.execute("SELECT v FROM bench_driver WHERE id = %s", (i,), prepare=True)
        return cur.fetchone()

    def by_raw(i: int) -> Any:
        raw.execute("SELECT v FROM bench_driver WHERE id = $1", (i,), prepare=True)
        return raw.fetchone()

    def by_pipeline(i: int) -> Any:
        with conn.pipeline():
            raw.execute("SELECT v FROM bench_driver WHERE id = $1", (i,), prepare=True)
        return raw.fetchone()

    def by_libpq(i: int) -> Any:
        result = pgconn.exec_prepared(b"bench_driver_read", [str(i).encode()])
        if result.status != psycopg.pq.ExecStatus.TUPLES_OK:
            raise RuntimeError(f"bench.driver: the libpq read failed: {result.error_message!r}")
        return result.get_value(0, 0)

    return dict(zip(WAYS, (by_cursor, by_raw, by_pipeline, by_libpq), strict=True))


def measure(url: str, *, statements: int, rounds: int, log: Callable[[str], None],
            server_local: bool = True) -> dict[str, Any]:
    """Per way, the client's and the backend's CPU microseconds per statement in each round
    (the backend's None unless ``server_local`` and its process is readable here)."""
    per_round: dict[str, list[dict[str, float | None]]] = {way: [] for way in WAYS}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_driver (id INT PRIMARY KEY, v TEXT NOT NULL)")
        conn.execute("INSERT INTO bench_driver SELECT g, 'value ' || g FROM generate_series(1, %s) g "
                     "ON CONFLICT DO NOTHING", (ROWS,))
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        backend = OnCpu(row[0])
        readable = server_local and backend.readable
        ways = _ways(conn)
        for way, send in ways.items():              # prepared, warm, and reading what it should
            for i in range(1, 20):
                got = send(i)
            if got not in (("value 19",), b"value 19"):
                raise RuntimeError(f"bench.driver: {way} read {got!r} for row 19")
        for r in range(rounds):
            for way in (WAYS if r % 2 == 0 else tuple(reversed(WAYS))):
                send = ways[way]
                client, server = time.process_time(), backend.seconds() if readable else 0.0
                for i in range(statements):
                    send(i % ROWS + 1)
                per_round[way].append({"client_us": (time.process_time() - client) / statements * 1e6,
                                       "server_us": (backend.seconds() - server) / statements * 1e6
                                       if readable else None})
            log(f"round {r + 1}/{rounds} done")
    return {"statements": statements, "rounds": rounds, "backend_time_exact": backend.exact if readable else None,
            "psycopg": psycopg.__version__, "psycopg_build": psycopg.pq.__impl__,
            "libpq": psycopg.pq.version(),
            "median": {way: {key: median([x[key] for x in rows]) for key in ("client_us", "server_us")}
                       for way, rows in per_round.items()},
            "per_round": per_round}


def table(out: dict[str, Any]) -> Table:
    t = Table(title=f"CPU microseconds per statement, median of {out['rounds']} rounds of {out['statements']} "
                    f"(PostgreSQL {out['server_version']})")
    for column in ("way", "client", "server"):
        t.add_column(column, justify="left" if column == "way" else "right")
    for way, m in out["median"].items():
        t.add_row(way, f"{m['client_us']:.1f}", "-" if m["server_us"] is None else f"{m['server_us']:.1f}")
    return t


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m bench.driver", __doc__, "driver-pg<major>-")
    p.add_argument("--statements", type=int, default=5000, help="statements per way and round (default 5000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    args = p.parse_args(argv)
    if args.statements < 1 or args.rounds < 1:
        p.error("--statements and --rounds must be at least 1")
    require_binaries(p, args.pgbin)
    server = scenario.start_server(args.pgbin)
    log = stderr_log("driver")
    with server.database() as url:
        out = measured_run(server.version,
                           "python -m bench.driver " + " ".join(argv if argv is not None else sys.argv[1:]),
                           lambda: measure(url, statements=args.statements, rounds=args.rounds, log=log,
                                           server_local=not os.environ.get(servers.ENV_URL)))
    publish(out, args.out, RESULTS, f"driver-pg{server.version_num // 10000}-", table(out), log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
