"""Backfill throughput: task rows per second written by ``composer-ops simulate --history-months``.

    .venv/bin/python -m bench.backfill                 # 6 months x 48,000 runs: about 2.1M task rows
    .venv/bin/python -m bench.backfill --months 3 --runs-per-month 100000 --keep
    .venv/bin/python -m bench.backfill --per-row-checks   # every foreign key checked by its trigger

What it measures: the whole backfill path of :func:`composer_ops.simulate.months.backfill`
on a freshly migrated database of its own (``bench_backfill_<pid>``, dropped at the
end unless ``--keep``): past partitions created with ``composer_ensure_partitions_from``,
each run replayed through the state machine on a simulated clock in worker processes
(one per CPU) while the calling process streams finished chunks with COPY (text format,
one transaction per month, every index, foreign key and partial index in place), then
ANALYZE of each month. The clock runs from the first partition to the last ANALYZE.
It prints task rows/s and the per-minute figure; the target is at least 1,000,000
task rows per minute. Not run by the test suite.

The server: ``COMPOSER_DATABASE_URL`` (the benchmark creates and drops its own
database there), otherwise the embedded PostgreSQL started in a temporary directory
and deleted at exit.

Where the time goes, per task row: about 63 us of client CPU (mostly the state
machine's decisions and the replay that applies them, then the COPY text), and on
the server about 15 us when the foreign keys are checked in bulk per chunk (a
superuser session, as on the embedded server), about 35 us when each row's trigger
checks it. The client's share of two cores is what bounds the rate.

Measured on the 2-core development machine with embedded PostgreSQL 18 (fsync on),
shared with other jobs, side by side on one server with the same sizes: 6 months x
20,000 runs (833,978 task rows, the history of ``make demo``) in 51.3 s = 974,511
task rows per minute at a load average of 4 under the heavy-jobs lock, where the
backfill that modelled the engine instead of replaying its machine (commit 0358a9c,
about 23 us of client CPU per task row) took 27.0 s = 1,852,885 per minute; 176.9 s
= 282,884 per minute against 56.7 s = 882,808 at a load average of 10 to 13.
2 months x 15,000 runs at a load average of 5: 498,113 and 532,651 per minute
against 990,490 and 1,034,026.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from composer_ops import Engine
from composer_ops.core.spec import parse_spec
from composer_ops.db.migrate import migrate
from composer_ops.simulate.definitions import definitions, deploy_definitions
from composer_ops.simulate.months import MonthsOptions, backfill, generated_months, month_sizes
from composer_ops.testing import servers

TARGET_PER_MINUTE = 1_000_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backfill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--months", type=int, default=6, help="months to backfill (default 6)")
    parser.add_argument("--runs-per-month", type=int, default=48_000, help="mean runs per month (default 48000)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the benchmark database")
    parser.add_argument("--per-row-checks", action="store_true",
                        help="check every row's foreign key by its trigger (what a non-superuser gets)")
    args = parser.parse_args(argv)

    admin = servers.session().primary.admin_url
    name = f"bench_backfill_{os.getpid()}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        version = conn.execute("SHOW server_version").fetchone()
    url = urlunsplit(urlsplit(admin)._replace(path=f"/{name}"))
    try:
        migrate(url)
        with Engine.connect(url, pool_size=2) as engine:
            deployed = deploy_definitions(engine)
            with engine.pool.connection() as conn:
                now = conn.execute("SELECT now()").fetchone()
        assert now is not None
        options = MonthsOptions(seed=args.seed, months=args.months, runs_per_month=args.runs_per_month,
                                 set_based_checks=not args.per_row_checks)
        planned = sum(month_sizes(generated_months(now[0], args.months), args.runs_per_month, 0.08).values())
        print(f"server PostgreSQL {version[0] if version else '?'}; backfilling {args.months} months, "
              f"{planned:,} runs into {name}", flush=True)
        done = [0, 0, time.perf_counter()]

        def progress(runs: int, tasks: int) -> None:
            done[0] += runs
            done[1] += tasks
            if time.perf_counter() - done[2] >= 10:
                done[2] = time.perf_counter()
                print(f"  {done[0]:,}/{planned:,} runs, {done[1]:,} task rows", flush=True)

        specs = {doc["id"]: parse_spec(doc) for doc in definitions()}
        result = backfill(url, specs, {wf: v for wf, (v, _) in deployed.items()}, options, now=now[0],
                          on_progress=progress)
        per_minute = result.task_rows_per_s * 60
        checks = "in bulk per chunk" if result.set_based_checks else "per row by their triggers"
        print(f"task rows {result.tasks:,}  all rows {result.rows:,}  seconds {result.seconds:.1f}  "
              f"foreign keys checked {checks}")
        print(f"backfill: {result.task_rows_per_s:,.0f} task rows/s = {per_minute:,.0f} task rows/min "
              f"({result.rows / result.seconds:,.0f} rows/s counting runs and signals); "
              f"target {TARGET_PER_MINUTE:,}/min: {'met' if per_minute >= TARGET_PER_MINUTE else 'NOT met'}")
        if result.tasks < 2_000_000:
            print("note: fewer than 2,000,000 task rows; raise --runs-per-month for the reference size")
        return 0 if per_minute >= TARGET_PER_MINUTE else 1
    finally:
        if not args.keep:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        else:
            print(f"kept database {name}: {url}")


if __name__ == "__main__":
    sys.exit(main())
