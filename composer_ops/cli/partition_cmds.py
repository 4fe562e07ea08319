"""``composer-ops partitions list|ensure|drop``."""

from __future__ import annotations

import argparse

from composer_ops.cli._common import EXIT_OK, add_database_option, emit_json, env_option
from composer_ops.db import connect
from composer_ops.repo import partitions


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parts = sub.add_parser("partitions", help="list, create ahead, or drop monthly partitions")
    psub = parts.add_subparsers(dest="partitions_command", required=True, metavar="{list,ensure}")

    lst = psub.add_parser("list", help="every partition of the three run-scoped tables")
    add_database_option(lst)
    lst.add_argument("--json", action="store_true", help="print a JSON list of objects")
    lst.set_defaults(func=cmd_list)

    ens = psub.add_parser("ensure", help="create this UTC month and N months ahead (idempotent)")
    add_database_option(ens)
    env_option(ens, "--months-ahead", env="COMPOSER_MONTHS_AHEAD", type=int, default=3,
               help="months to create beyond the current one")
    ens.set_defaults(func=cmd_ensure)


def cmd_list(args: argparse.Namespace) -> int:
    with connect(args.database_url, application_name="composer-ops partitions") as conn:
        rows = partitions.list_partitions(conn)
    if args.json:
        emit_json([{"month": r.month, "table": r.table, "name": r.name,
                    "lower_bound": r.lower_bound, "upper_bound": r.upper_bound} for r in rows])
        return EXIT_OK
    print(f"{'month':<7} {'table':<16} {'partition':<26} bounds")
    for r in rows:
        print(f"{r.month:<7} {r.table:<16} {r.name:<26} [{r.lower_bound}, {r.upper_bound})")
    return EXIT_OK


def cmd_ensure(args: argparse.Namespace) -> int:
    if args.months_ahead < 0:
        from composer_ops.errors import Invalid

        raise Invalid(f"--months-ahead must be 0 or more, got {args.months_ahead}")
    with connect(args.database_url, application_name="composer-ops partitions") as conn:
        created = partitions.ensure(conn, args.months_ahead)
        conn.commit()
    print(f"created {created} partitions")
    return EXIT_OK
