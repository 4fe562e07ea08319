"""``composer-ops partitions list|ensure|drop``."""

from __future__ import annotations

import argparse
from datetime import datetime
from typing import Any

from composer_ops.cli import archive_cmds
from composer_ops.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    add_command,
    add_json_option,
    at_least,
    emit_json,
    env_option,
    open_engine,
    say,
)
from composer_ops.cli.admin_cmds import actor
from composer_ops.db import connect
from composer_ops.ops.display import iec_bytes
from composer_ops.repo.partitions import RUN_TABLES
from composer_ops.repo.rows import RetentionMonth

#: ``partitions drop`` (dry-run or --yes): months past the cut-off were kept because runs
#: in them are still active; they are named on stderr. Retention is stuck until they end.
EXIT_RETENTION_BLOCKED = 3


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parts = sub.add_parser("partitions", help="list, create ahead, or drop monthly partitions")
    psub = parts.add_subparsers(dest="partitions_command", required=True,
                                metavar="{list,ensure,drop,archive,detach,restore}")

    tables = ", ".join(RUN_TABLES)
    lst = add_command(psub, "list", cmd_list, database="reads",
                      help=f"every partition of the run-scoped tables ({tables})")
    add_json_option(lst, "print a JSON list of objects")

    ens = add_command(psub, "ensure", cmd_ensure, help="create this UTC month and N months ahead (idempotent)")
    add_months_ahead_option(ens, "months to create beyond the current one")

    drp = add_command(
        psub, "drop", cmd_drop, database="reads",
        help="retention: drop whole months older than a cut-off (dry-run unless --yes)",
        description="Show (default) or apply the retention plan: every partition month ended at or before "
                    "the cut-off (and at least an hour ago) with no RUNNING/PENDING run, and whose partitions' bounds "
                    "are its name's month, is dropped, for every "
                    f"run-scoped table ({tables}). The dry-run and --yes use the same SQL plan "
                    "(composer_retention_plan); --yes judges each month again while holding its partitions' locks.",
        epilog="Exit codes: 0 ok; 1 failed (nothing dropped in the failing attempt), or a month was refused "
               "because a partition of it has bounds that are not its name's month (named on stderr with its "
               "bounds; dry run or not, the rest of the plan goes on); 2 bad input; "
               "3 months past the cut-off were kept because they still have active runs (named on stderr; "
               "the rest of the plan was applied).")
    archive_cmds.add_cutoff_option(drp)
    mode = drp.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", dest="yes", action="store_false", default=False,
                      help="print the plan, drop nothing (the default)")
    mode.add_argument("--yes", dest="yes", action="store_true", help="drop the planned months for real")
    add_json_option(drp, "print a JSON list of objects (month, action, reason, ...; with --yes also dropped)")
    archive_cmds.add_lock_options(drp)
    env_option(drp, "--archive", env="COMPOSER_ARCHIVE_DIR", metavar="DIR",
               help="archive each month first (as `partitions archive` does) and drop it only once its archive "
                    "verified and its rows are unchanged, month by month; ~ is expanded, an empty value is refused "
                    "(exit 2)")
    archive_cmds.register(psub)


def add_months_ahead_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--months-ahead``: how many partition months are kept beyond the current one."""
    env_option(parser, "--months-ahead", env="COMPOSER_MONTHS_AHEAD", type=int, default=3, accepts=at_least(0),
               metavar_default="3", help=help)


def cmd_list(args: argparse.Namespace) -> int:
    with open_engine(args) as engine:
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
    from composer_ops.db.roles import check_first, require_engine

    with open_engine(args) as engine:
        check_first(engine.pool, require_engine, "partitions ensure", "EXECUTE", "composer_ensure_partitions(integer)")
        created = engine.ensure_partitions(args.months_ahead)
    print(f"created {created} partitions")
    return EXIT_OK


def _records(plan: list[RetentionMonth], cutoff: datetime, dropped: list[str] | None) -> list[dict[str, Any]]:
    records = []
    for m in plan:
        rec: dict[str, Any] = {
            "month": m.month, "action": m.action, "reason": m.reason,
            "active_runs": m.active_runs, "active_run_ids": m.active_run_ids,
            "partitions": m.partitions, "rows": m.rows, "bytes": m.bytes,
            "cutoff": cutoff.isoformat().replace("+00:00", "Z"),
        }
        if dropped is not None:
            rec["dropped"] = m.month in dropped
        records.append(rec)
    return records


def cmd_drop(args: argparse.Namespace) -> int:
    from composer_ops.engine.retention import BLOCKED_REASONS, drop_due_months, misaligned
    from composer_ops.repo import retention

    when = archive_cmds.cutoff(args)
    dropped: list[str] | None = None
    if args.archive is not None:        # given, even empty: an empty one is refused, never a plain drop
        return archive_cmds.drop_archived(args, when)
    if args.yes:
        result = drop_due_months(args.database_url, when, lock_timeout_s=args.lock_timeout,
                                 max_attempts=args.attempts, actor=actor(args))
        plan, cutoff, dropped = result.plan, result.cutoff, result.dropped
    else:
        with connect(args.database_url, application_name="composer-ops partitions drop") as conn:
            judged = retention.plan(conn, when)
            plan, cutoff = judged.months, judged.cutoff
            conn.rollback()
    blocked = [m for m in plan if m.action == "keep" and m.reason in BLOCKED_REASONS]
    if args.json:
        emit_json(_records(plan, cutoff, dropped))
    else:
        _print_plan(plan, cutoff, when.text, dropped)
    code = blocked_exit(blocked)
    for m in misaligned(plan):
        say(f"month {m.month} not dropped: {m.reason}")
        code = EXIT_FAILED
    return code


def blocked_exit(blocked: list[RetentionMonth]) -> int:
    """0, or :data:`EXIT_RETENTION_BLOCKED` naming the blocked months on stderr."""
    if not blocked:
        return EXIT_OK
    named = "; ".join(f"{m.month} kept for {m.active_runs} {_why(m)} "
                      f"({', '.join(m.active_run_ids)}{', ...' if m.active_runs > len(m.active_run_ids) else ''})"
                      for m in blocked)
    say(f"retention blocked: {named}")
    return EXIT_RETENTION_BLOCKED


def _why(m: RetentionMonth) -> str:
    runs = "run" if m.active_runs == 1 else "runs"
    return f"active {runs}" if m.reason == "has active runs" else f"finished {runs} with live child runs"


def _print_plan(plan: list[RetentionMonth], cutoff: datetime, text: str, dropped: list[str] | None) -> None:
    print(f"retention cut-off {cutoff:%Y-%m-%dT%H:%M:%SZ} ({text}): {'dry-run' if dropped is None else 'DROPPING'}")
    print(f"{'month':<7} {'action':<6} {'reason':<29} {'rows':>10} {'bytes':>10}  blocking runs")
    for m in plan:
        more = f" (+{m.active_runs - len(m.active_run_ids)} more)" if m.active_runs > len(m.active_run_ids) else ""
        print(f"{m.month:<7} {m.action:<6} {m.reason:<29} {m.rows:>10} "
              f"{iec_bytes(m.bytes):>10}  {', '.join(m.active_run_ids)}{more}")
    to_drop = [m for m in plan if m.action == "drop"]
    rows, size = sum(m.rows for m in to_drop), iec_bytes(sum(m.bytes for m in to_drop))
    if dropped is None:
        print(f"would drop {len(to_drop)} month(s), about {rows} rows and {size}; "
              "nothing was changed (add --yes to drop)")
        return
    for m in to_drop:
        if m.month in dropped:
            print(f"dropped {m.month}: {', '.join(m.partitions)}")
    print(f"dropped {len(dropped)} month(s), about {rows} rows and {size}")
