"""``composer-ops partitions archive|restore|detach``: months of the run tables kept as
Parquet (or as standalone tables) before retention drops them, and brought back."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_ops.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    above,
    add_command,
    add_json_option,
    add_yes_option,
    at_least,
    database_url,
    emit_json,
    env_option,
    say,
)
from composer_ops.cli.admin_cmds import actor, progress_bars
from composer_ops.core.cutoff import Cutoff, parse_cutoff
from composer_ops.errors import Invalid

if TYPE_CHECKING:
    from composer_ops.engine.archive import MonthArchived


def add_cutoff_option(parser: argparse.ArgumentParser) -> None:
    """``--older-than WHEN``: the retention cut-off every plan-driven command takes."""
    env_option(parser, "--older-than", env="COMPOSER_RETENTION_OLDER_THAN", metavar="WHEN",
               help="cut-off: ISO date (2025-01-31, midnight UTC), ISO instant, or an age counted back from "
                    "the database clock (90d, 2w, 6 months, 1y, 36h)")


def cutoff(args: argparse.Namespace) -> Cutoff:
    """The parsed ``--older-than`` (:class:`Invalid` when it is missing or not a cut-off)."""
    if not args.older_than:
        raise Invalid("--older-than WHEN is required (an ISO date, an ISO instant, or an age like 90d)")
    return parse_cutoff(args.older_than)


def archive_directory(value: str | None, flag: str) -> Path:
    """The archive directory given as ``flag`` (or COMPOSER_ARCHIVE_DIR), ``~`` expanded:
    the one reading of it for ``--to``, ``--archive`` and ``--from``. :class:`Invalid`
    (exit 2, before anything is done) when it is missing, empty or blank: an unset shell
    variable must not turn ``drop --archive "$DIR"`` into a drop without an archive."""
    if value is None:
        raise Invalid(f"{flag} DIR is required (or COMPOSER_ARCHIVE_DIR)")
    if not value.strip():
        raise Invalid(f"{flag} {value!r} (or COMPOSER_ARCHIVE_DIR): the archive directory is empty; "
                      "name a directory (an unset shell variable?)")
    return Path(value).expanduser()


def add_lock_options(parser: argparse.ArgumentParser, *, attempts: bool = True) -> None:
    """``--lock-timeout`` (and ``--attempts``): how long DDL waits for a lock, how often it tries."""
    env_option(parser, "--lock-timeout", env="COMPOSER_RETENTION_LOCK_TIMEOUT", type=float, default=2.0,
               accepts=above(0), metavar_default="2",
               help="seconds to wait for a partition lock before backing off and retrying")
    if attempts:
        env_option(parser, "--attempts", env="COMPOSER_RETENTION_ATTEMPTS", type=int, default=5,
                   accepts=at_least(1), metavar_default="5",
                   help="tries (per month, month by month) before giving up when the locks stay busy")


def register(psub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The archive subcommands, under ``composer-ops partitions``."""
    arc = add_command(
        psub, "archive", cmd_archive, database="reads",
        help="write every month retention would drop as Parquet, verified (changes no data)",
        description="For the months the retention plan would drop for --older-than (the plan `partitions drop` "
                    "follows), write each run table's partition to DIR/YYYYMM/<table>.parquet (zstd) with a "
                    "manifest (month, bounds, rows, schema version, SHA-256 of every file and of its content), "
                    "re-read every file to verify it, and only then move it into place and write an audit row. An "
                    "archive of the month in DIR holding more rows of a table than the month now does is kept "
                    "and the month refused (exit 1; the other months go on). "
                    "Nothing in the database changes except the audit rows. Exit 0 archived (or, with --dry-run, "
                    "listed), 1 a month could not be archived, 2 bad input.")
    add_cutoff_option(arc)
    env_option(arc, "--to", dest="target", env="COMPOSER_ARCHIVE_DIR", metavar="DIR",
               help="the archive directory (created if missing; ~ is expanded; an empty value is refused; an earlier "
                    "archive of a month is replaced, unless it holds more rows of a table: that month is refused)")
    arc.add_argument("--dry-run", action="store_true", help="list the months it would archive, write nothing")
    add_json_option(arc)

    det = add_command(
        psub, "detach", cmd_detach, database="reads",
        help="retention that keeps the months: detach them as standalone tables (dry-run unless --yes)",
        description="For the months the retention plan would drop for --older-than (the plan `partitions drop` "
                    "follows), detach each month's partitions from the run tables instead of dropping them, and "
                    "move them, under the same names, to the schema composer_detached (pg_partman's "
                    "retention_keep_table): the engine and the reports no longer see them, the data stays. Month "
                    "by month, each judged again under its locks, with an audit row. Exit codes as `partitions "
                    "drop`: 3 when months past the cut-off were kept for active runs; 1 when a month was "
                    "refused because composer_detached holds a copy of it already (detached before, restored "
                    "since): the other months go on. Refused on Citus (exit 2, nothing changed): use "
                    "`partitions drop --archive DIR` there.")
    add_cutoff_option(det)
    add_yes_option(det, "detach for real (without: print the plan)")
    add_json_option(det)
    add_lock_options(det)

    rst = add_command(
        psub, "restore", cmd_restore, database="reads",
        help="re-import an archived month with COPY (dry-run unless --yes)",
        description="Verify DIR/MONTH against its manifest (every file re-read), then with --yes create the "
                    "month's partitions where they are missing and COPY every table back in one transaction, "
                    "which checks the rows against the manifest and writes an audit row (when it fails, the "
                    "partitions it created are dropped again). A month whose "
                    "partitions hold rows is refused (exit 1), and so, before anything is written, is an archive "
                    "whose runs are of a definition version the database does not hold (exit 2). Exit 0 restored "
                    "(or would restore), 1 the archive is bad or the restore failed, 2 bad input.")
    rst.add_argument("month", metavar="MONTH", help="the month to restore, YYYYMM")
    env_option(rst, "--from", dest="source", env="COMPOSER_ARCHIVE_DIR", metavar="DIR",
               help="the archive directory (the one `partitions archive --to` wrote; ~ is expanded)")
    add_yes_option(rst, "restore for real (without: verify and say what it would do)")
    add_json_option(rst)
    add_lock_options(rst, attempts=False)


def cmd_restore(args: argparse.Namespace) -> int:
    from composer_ops.core.runids import month_start
    from composer_ops.engine.archive import restore_month

    month_start(args.month)                                  # YYYYMM, else exit 2
    source = archive_directory(args.source, "--from")
    if not source.is_dir():          # bad input, exit 2: a damaged archive is exit 1
        raise Invalid(f"--from {args.source}: no such directory")
    with progress_bars() as bars:
        result = restore_month(args.database_url, args.month, source, yes=args.yes, actor=actor(args),
                               lock_timeout_s=args.lock_timeout, progress=bars)
    if args.json:
        out: dict[str, Any] = {"month": result.month, "from": result.source, "restored": result.applied,
                               "rows": result.rows,
                               "tables": [{"table": t.table, "partition": t.partition, "rows": t.rows,
                                           "fingerprint_matches": t.fingerprint_matches} for t in result.tables]}
        emit_json(out)
        return EXIT_OK
    verb = "restored" if result.applied else "would restore"
    for t in result.tables:
        check = {True: "fingerprint matches", False: "fingerprint differs", None: ""}[t.fingerprint_matches]
        print(f"{verb} {t.rows:>9} rows into {t.partition:<28} {check}".rstrip())
    tail = "" if result.applied else "; the archive verified, nothing was changed (add --yes to restore)"
    print(f"{verb} month {result.month} from {result.source}: {result.rows} rows{tail}")
    return EXIT_OK


def cmd_archive(args: argparse.Namespace) -> int:
    from composer_ops.engine.archive import archive_due

    when = cutoff(args)
    target = archive_directory(args.target, "--to")
    with progress_bars() as bars:
        result = archive_due(database_url(args), when, target, dry_run=args.dry_run,
                             actor=actor(args), progress=bars)
    if args.json:
        emit_json({"cutoff": result.cutoff, "dry_run": args.dry_run,
                   "months": [{"month": m.month, "path": m.path, "rows": m.rows, "archived": m.written,
                               "refused": m.refused or None, "partitions": m.partitions} for m in result.months],
                   "kept": [{"month": month, "reason": reason} for month, reason in result.kept]})
        return _refused_exit(result.months)
    print(f"retention cut-off {result.cutoff:%Y-%m-%dT%H:%M:%SZ}: "
          f"{'dry-run' if args.dry_run else 'archiving'} the months it would drop")
    for m in result.months:
        if m.written:
            print(f"archived {m.month}: {m.rows} rows, verified, in {m.path}")
        elif m.refused:
            print(f"refused {m.month}: {m.refused}")
        else:
            print(f"would archive {m.month}: about {m.rows} rows to {m.path}")
    if not result.months:
        print("no month is due for retention: nothing to archive")
    elif args.dry_run:
        print("nothing was written (run it without --dry-run to archive)")
    return _refused_exit(result.months)


def _refused_exit(months: list[MonthArchived]) -> int:
    """0, or 1 naming on stderr each month not archived (the others were)."""
    for m in months:
        if m.refused:
            say(f"month {m.month} not archived: {m.refused}")
    return EXIT_FAILED if any(m.refused for m in months) else EXIT_OK


def cmd_detach(args: argparse.Namespace) -> int:
    return _retire(args, cutoff(args), archive_dir=None, keep_table=True)


def drop_archived(args: argparse.Namespace, when: Cutoff) -> int:
    """``partitions drop --archive DIR``: archive each month, drop it once verified."""
    return _retire(args, when, archive_dir=archive_directory(args.archive, "--archive"), keep_table=False)


def _retire(args: argparse.Namespace, when: Cutoff, *, archive_dir: Path | None, keep_table: bool) -> int:
    from composer_ops.cli.partition_cmds import blocked_exit
    from composer_ops.core.manifest import BadArchive
    from composer_ops.engine.retention import misaligned
    from composer_ops.engine.retire import retire_months

    if archive_dir is not None and args.yes:
        from composer_ops.engine.archive import check_directory

        check_directory(archive_dir)
    try:
        with progress_bars() as bars:
            result = retire_months(database_url(args), when, archive_dir=archive_dir, keep_table=keep_table,
                                   yes=args.yes, actor=actor(args), lock_timeout_s=args.lock_timeout,
                                   max_attempts=args.attempts, progress=bars)
    except BadArchive as exc:
        say(f"archive not verified: {exc}")
        return EXIT_FAILED
    if args.json:
        emit_json({"cutoff": result.cutoff, "applied": result.applied,
                   "months": [{"month": m.month, "outcome": m.outcome, "reason": m.reason, "rows": m.rows,
                               "rows_estimated": m.estimated,
                               "partitions": m.partitions, "archive": m.archive} for m in result.months],
                   "kept": [{"month": m.month, "reason": m.reason, "active_runs": m.active_runs}
                            for m in result.plan if m.action == "keep"]})
    else:
        what = "detach" if keep_table else "archive and drop"
        print(f"retention cut-off {result.cutoff:%Y-%m-%dT%H:%M:%SZ}: "
              f"{what} {'for real' if result.applied else '(dry-run)'}")
        for m in result.months:
            where = f", archived in {m.archive}" if m.archive and m.outcome == "dropped" else ""
            why = f" ({m.reason})" if m.reason else ""
            print(f"{m.outcome} {m.month}: {'about ' if m.estimated else ''}{m.rows} rows{where}{why}")
        for planned in result.plan:
            if planned.action == "keep" and planned.reason != "too new" and planned not in misaligned(result.plan):
                print(f"kept {planned.month}: {planned.reason} ({planned.active_runs} active runs)")
        if not result.months:
            print("no month is due for retention")
        elif not result.applied:
            print("nothing was changed (add --yes)")
    refused = [m for m in result.months if m.outcome == "refused"]
    for m in refused:
        say(f"month {m.month} not {'detached' if keep_table else 'dropped'}: {m.reason}")
    return EXIT_FAILED if refused else blocked_exit(result.blocked)
