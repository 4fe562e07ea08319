"""``composer-ops partitions list|ensure|drop``."""

from __future__ import annotations

import argparse
from typing import Any

from composer_ops.cli._common import EXIT_OK, add_database_option, emit_json, env_option
from composer_ops.db import find_url
from composer_ops.engine import Engine
from composer_ops.errors import Invalid
from composer_ops.ops.display import iec_bytes


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parts = sub.add_parser("partitions", help="list, create ahead, or drop monthly partitions")
    psub = parts.add_subparsers(dest="partitions_command", required=True, metavar="{list,ensure,drop}")

    lst = psub.add_parser("list", help="every partition of the three run-scoped tables")
    add_database_option(lst, reads_only=True)
    lst.add_argument("--json", action="store_true", help="print a JSON list of objects")
    lst.set_defaults(func=cmd_list)

    ens = psub.add_parser("ensure", help="create this UTC month and N months ahead (idempotent)")
    add_database_option(ens)
    env_option(ens, "--months-ahead", env="COMPOSER_MONTHS_AHEAD", type=int, default=3,
               help="months to create beyond the current one")
    ens.set_defaults(func=cmd_ensure)

    drp = psub.add_parser(
        "drop", help="retention: drop whole months older than a cut-off (dry-run unless --yes)",
        description="Show (default) or apply the retention plan: every partition month ended at or before "
                    "the cut-off with no RUNNING/PENDING run is dropped, for all three run-scoped tables. "
                    "The dry-run and --yes use the same SQL plan (composer_retention_plan).")
    add_database_option(drp, reads_only=True)
    env_option(drp, "--older-than", env="COMPOSER_RETENTION_OLDER_THAN", metavar="WHEN",
               help="cut-off: ISO date (2025-01-31, midnight UTC), ISO instant, or an age counted back from "
                    "the database clock (90d, 2w, 6 months, 1y, 36h)")
    mode = drp.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", dest="yes", action="store_false", default=False,
                      help="print the plan, drop nothing (the default)")
    mode.add_argument("--yes", dest="yes", action="store_true", help="drop the planned months for real")
    drp.add_argument("--json", action="store_true",
                     help="print a JSON list of objects (month, action, reason, ...; with --yes also dropped)")
    env_option(drp, "--lock-timeout", env="COMPOSER_RETENTION_LOCK_TIMEOUT", type=float, default=2.0,
               metavar_default="2", help="seconds to wait for a partition lock before backing off and retrying")
    env_option(drp, "--attempts", env="COMPOSER_RETENTION_ATTEMPTS", type=int, default=5, metavar_default="5",
               help="tries before giving up when the locks stay busy")
    drp.set_defaults(func=cmd_drop)


def _engine(args: argparse.Namespace, *, reads_only: bool = False) -> Engine:
    """The engine of one command; ``list`` only reads, so it never starts the embedded server."""
    url = find_url(args.database_url) if reads_only else args.database_url
    return Engine.connect(url, pool_size=1, application_name="composer-ops partitions")


def cmd_list(args: argparse.Namespace) -> int:
    with _engine(args, reads_only=True) as engine:
        rows = engine.list_partitions()
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
        raise Invalid(f"--months-ahead must be 0 or more, got {args.months_ahead}")
    with _engine(args) as engine:
        created = engine.ensure_partitions(args.months_ahead)
    print(f"created {created} partitions")
    return EXIT_OK


def _plan_records(plan: Any, dropped: list[str] | None) -> list[dict[str, Any]]:
    records = []
    for row in plan.iter_rows(named=True):
        rec: dict[str, Any] = {
            "month": row["month"], "action": row["action"], "reason": row["reason"],
            "active_runs": row["active_runs"], "active_run_ids": row["active_run_ids"],
            "partitions": row["partitions"], "rows": row["rows"], "bytes": row["bytes"],
            "cutoff": row["cutoff"].isoformat().replace("+00:00", "Z"),
        }
        if dropped is not None:
            rec["dropped"] = row["month"] in dropped
        records.append(rec)
    return records


def cmd_drop(args: argparse.Namespace) -> int:
    from composer_ops.ops import retention

    if not args.older_than:
        raise Invalid("--older-than WHEN is required (an ISO date, an ISO instant, or an age like 90d)")
    cutoff = retention.parse_cutoff(args.older_than)
    if args.lock_timeout <= 0 or args.attempts < 1:
        raise Invalid(f"--lock-timeout must be > 0 and --attempts >= 1, got {args.lock_timeout} and {args.attempts}")
    if args.yes:
        result = retention.drop_partitions(args.database_url, cutoff, lock_timeout_s=args.lock_timeout,
                                           max_attempts=args.attempts)
        plan, dropped = result.plan, result.dropped
    else:
        plan, dropped = retention.retention_plan(args.database_url, cutoff), None
    if args.json:
        emit_json(_plan_records(plan, dropped))
        return EXIT_OK
    instant = plan["cutoff"][0] if plan.height else None
    shown = instant.strftime("%Y-%m-%dT%H:%M:%SZ") if instant is not None else cutoff.text
    print(f"retention cut-off {shown} ({cutoff.text}): {'DROPPING' if args.yes else 'dry-run'}")
    print(f"{'month':<7} {'action':<6} {'reason':<29} {'rows':>10} {'bytes':>10}  blocking runs")
    for row in plan.iter_rows(named=True):
        ids = row["active_run_ids"]
        more = f" (+{row['active_runs'] - len(ids)} more)" if row["active_runs"] > len(ids) else ""
        print(f"{row['month']:<7} {row['action']:<6} {row['reason']:<29} {row['rows']:>10} "
              f"{iec_bytes(row['bytes']):>10}  {', '.join(ids)}{more}")
    to_drop = plan.filter(plan["action"] == "drop")
    rows, size = int(to_drop["rows"].sum()), iec_bytes(int(to_drop["bytes"].sum()))
    if dropped is None:
        print(f"would drop {to_drop.height} month(s), about {rows} rows and {size}; "
              "nothing was changed (add --yes to drop)")
    else:
        for month in dropped:
            parts = to_drop.filter(to_drop["month"] == month)["partitions"][0].to_list()
            print(f"dropped {month}: {', '.join(parts)}")
        print(f"dropped {len(dropped)} month(s), about {rows} rows and {size}")
    return EXIT_OK
