"""``composer-ops db up|url|stop`` and ``composer-ops migrate``."""

from __future__ import annotations

import argparse
import os
import sys

from composer_ops.cli._common import EXIT_FAILED, EXIT_OK, above, add_command, at_least, env_option
from composer_ops.db import embedded
from composer_ops.db.migrate import CHANGED, LOCK_ATTEMPTS, LOCK_TIMEOUT_S, migrate, status
from composer_ops.errors import Invalid


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    db = add_command(sub, "db", cmd_db, help="the embedded PostgreSQL server (data under COMPOSER_HOME)", database=None)
    env_option(db, "--home", env="COMPOSER_HOME", help="directory holding the embedded server's data",
               default=".composer")
    dsub = db.add_subparsers(dest="db_command", required=True, metavar="{up,url,stop}")
    dsub.add_parser("up", help="start the embedded server (it keeps running) and print its URL")
    dsub.add_parser("url", help="print the embedded server's URL (exit 1 if it is not running)")
    dsub.add_parser("stop", help="stop the embedded server")

    mig = add_command(sub, "migrate", cmd_migrate, help="apply pending sql/V*.sql migrations in order")
    mig.add_argument("--status", action="store_true",
                     help="list migrations: applied, pending, or changed after it was applied (exit 2: migrate "
                          "refuses it)")
    mig.add_argument("--citus", action="store_true", default=os.environ.get("COMPOSER_CITUS") == "1",
                     help="require a Citus coordinator and apply its series (sql/citus/ too: the tables are "
                          "distributed by run ID); without it a database with the citus extension is still "
                          "detected [env: COMPOSER_CITUS=1]")
    env_option(mig, "--lock-timeout", env="COMPOSER_MIGRATE_LOCK_TIMEOUT", type=float, default=LOCK_TIMEOUT_S,
               accepts=above(0), metavar_default=f"{LOCK_TIMEOUT_S:g}",
               help="seconds each migration file waits for a lock (behind a long transaction) before it is "
                    "rolled back and tried again; the engine's statements on that table wait no longer")
    env_option(mig, "--attempts", env="COMPOSER_MIGRATE_ATTEMPTS", type=int, default=LOCK_ATTEMPTS,
               accepts=at_least(1), metavar_default=str(LOCK_ATTEMPTS),
               help="tries per file before giving up, naming the sessions that hold locks")


def cmd_db(args: argparse.Namespace) -> int:
    from pathlib import Path

    base = Path(args.home).expanduser().resolve()
    if args.db_command == "up":
        print(embedded.up(base))
        return EXIT_OK
    if args.db_command == "url":
        url = embedded.running_url(base)
        if url is None:
            sys.stderr.write(f"composer-ops: embedded PostgreSQL under {base} is not running "
                             "(start it with `composer-ops db up`)\n")
            return EXIT_FAILED
        print(url)
        return EXIT_OK
    stopped = embedded.stop(base)
    print("stopped" if stopped else "not running")
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.status:
        found = status(args.database_url)
        for mig, state in found:
            print(f"{state}  {mig.filename}")
        changed = [mig.filename for mig, state in found if state == CHANGED]
        if changed:
            raise Invalid(f"{', '.join(changed)} changed after it was applied; `composer-ops migrate` refuses it "
                          "(add a new migration instead of editing an applied one)")
        return EXIT_OK
    done = migrate(args.database_url, on_apply=lambda m: print(f"applied {m.filename}", flush=True),
                   citus=True if args.citus else None, lock_timeout_s=args.lock_timeout, attempts=args.attempts)
    if not done:
        print("schema is up to date")
    return EXIT_OK
