"""``composer-ops report NAME|--all [-p KEY VALUE ...] [--out DIR]``: run the
operations notebooks with papermill and file them as HTML reports; ``composer-ops
check``: the deployment's health against thresholds, for cron and monitoring."""

from __future__ import annotations

import argparse
import os
import typing
from pathlib import Path

from composer_ops.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    add_command,
    add_json_option,
    add_read_lock_wait_option,
    emit_json,
    env_option,
    say,
)
from composer_ops.errors import ComposerError, Invalid
from composer_ops.files import check_directory
from composer_ops.ops import health

#: ``check``'s thresholds: the :class:`~composer_ops.ops.health.Thresholds` field each
#: option sets (its type and default come from there), option, environment variable,
#: metavar, help.
_THRESHOLDS = (
    ("months_ahead_min", "--months-ahead-min", "COMPOSER_CHECK_MONTHS_AHEAD_MIN", "N",
     "alert when fewer partition months exist after the current one"),
    ("sweeper_lag_s", "--sweeper-lag", "COMPOSER_CHECK_SWEEPER_LAG", "SECONDS",
     "alert when a lease expired more than this many seconds ago and its task is still RUNNING"),
    ("timers_overdue_s", "--timers-overdue", "COMPOSER_CHECK_TIMERS_OVERDUE", "SECONDS",
     "alert when a WAITING task's timer (a WAIT node, a WAIT_FOR_SIGNAL timeout), or a dispatch's "
     "schedule_to_start deadline, passed more than this many seconds ago: no coordinator fires timers"),
    ("replay_lag_s", "--replay-lag", "COMPOSER_CHECK_REPLAY_LAG", "SECONDS",
     "on a hot standby, alert when its replay lags the primary by more than this many seconds"),
    ("outbox_ready_age_s", "--outbox-ready-age", "COMPOSER_CHECK_OUTBOX_READY_AGE", "SECONDS",
     "alert when a claimable dispatch has waited more than this many seconds"),
    ("retention_older_than", "--retention-older-than", "COMPOSER_RETENTION_OLDER_THAN", "WHEN",
     "the retention cut-off: alert when months past it are kept for active runs"),
    ("long_wait_h", "--long-wait-h", "COMPOSER_CHECK_LONG_WAIT_H", "HOURS",
     "alert on WAIT_FOR_SIGNAL nodes without a timeout waiting longer than this many hours"),
    ("webhook_attempts", "--webhook-attempts", "COMPOSER_CHECK_WEBHOOK_ATTEMPTS", "N",
     "alert on webhook deliveries still retried after this many attempts"),
    ("schedule_late_s", "--schedule-late", "COMPOSER_CHECK_SCHEDULE_LATE", "SECONDS",
     "alert on a schedule whose last due slot did not start within this many seconds (or was missed)"),
    ("queue_paused_h", "--queue-paused-h", "COMPOSER_CHECK_QUEUE_PAUSED_H", "HOURS",
     "alert on a queue paused (composer-ops queues pause) longer than this many hours"),
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    rep = add_command(
        sub, "report", cmd_report, database="reads", help="execute operations notebooks and write HTML reports",
        description="Execute notebooks from the notebooks directory with papermill and write "
                    "OUT/<notebook>/<UTC timestamp>.html (code hidden, plotly embedded) beside the executed "
                    ".ipynb, then OUT/index.html. Exit 1 if a notebook fails (the failing cell is named), "
                    "2 for an unknown notebook or parameter.")
    rep.add_argument("names", nargs="*", metavar="NAME", help="notebook(s) to run, e.g. retention_dry_run")
    rep.add_argument("--all", action="store_true", help="run every notebook")
    rep.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                     help="set a notebook parameter (repeatable); with --all, applies to the notebooks declaring it")
    env_option(rep, "--out", env="COMPOSER_REPORTS_DIR", default="reports", metavar_default="reports",
               help="directory the reports and index.html are written to")
    env_option(rep, "--timeout", env="COMPOSER_REPORT_CELL_TIMEOUT", type=int, default=600,
               metavar_default="600",
               help="seconds one cell may run; then it is interrupted and the report fails naming it")
    add_read_lock_wait_option(rep)
    env_option(rep, "--progress", env="COMPOSER_REPORT_PROGRESS", default="1", choices=["0", "1"],
               metavar_default="1", help="show a progress bar per notebook (0: no)")
    env_option(rep, "--jobs", env="COMPOSER_REPORT_JOBS", type=int, default=1, metavar_default="1",
               help="notebooks to execute at once, each in its own kernel (progress bars only with 1)")
    env_option(rep, "--keep", env="COMPOSER_REPORT_KEEP", type=int, default=0, metavar_default="0",
               help="after writing, keep only the newest N reports of each notebook run here (0: keep all)")
    rep.add_argument("--list", action="store_true", help="list the notebooks and their parameters, run nothing")

    chk = add_command(
        sub, "check", cmd_check, database="reads",
        help="deployment health against thresholds (exit 0 healthy, 1 alert, 2 bad input)",
        description="Read the database once and judge ten figures: replay lag (on a hot standby), partition "
                    "months ahead, sweeper lag, timers overdue (a stopped coordinator), the oldest ready outbox "
                    "row (paused queues and queues at their limit not counted), retention blocked by active "
                    "runs, WAIT_FOR_SIGNAL nodes without a timeout waiting long, failing webhook deliveries, late "
                    "schedules, queues paused long; each alert names its runbook (composer-ops runbook NAME). "
                    "Exit 0 when healthy, 1 when a check alerts (or the database cannot be read: then "
                    "--prometheus writes composer_check_up 0 and --json an error object), 2 for bad input.")
    add_json_option(chk, "print the checks as a JSON object")
    env_option(chk, "--prometheus", env="COMPOSER_CHECK_PROMETHEUS", metavar="FILE",
               help="also write the figures in the Prometheus text format to FILE (atomically; for "
                    "node_exporter's textfile collector, e.g. /var/lib/node_exporter/textfile/composer.prom)")
    kinds = typing.get_type_hints(health.Thresholds)
    for field, flag, env, metavar, text in _THRESHOLDS:
        default = kinds[field](getattr(health.Thresholds, field))
        env_option(chk, flag, dest=field, env=env, type=kinds[field], default=default, metavar=metavar,
                   metavar_default=default if isinstance(default, str) else f"{default:g}", help=text)


def cmd_report(args: argparse.Namespace) -> int:
    from composer_ops import reports

    if args.list:
        for name in reports.available():
            declared = reports.declared_parameters(name)
            print(name)
            for p in declared.values():
                print(f"    -p {p.name} (default {p.default})  {p.help}")
        return EXIT_OK
    if args.all and args.names:
        raise Invalid("give report names or --all, not both")
    if not args.all and not args.names:
        raise Invalid(f"give a report name or --all; available: {', '.join(reports.available())}")
    names = reports.available() if args.all else list(dict.fromkeys(args.names))
    for name in names:
        reports.notebook_path(name)  # unknown name: NotFound, exit 2, before anything runs
    if args.timeout < 1 or args.jobs < 1:
        raise Invalid(f"--timeout and --jobs must be at least 1, got {args.timeout} and {args.jobs}")
    if args.keep < 0:
        raise Invalid(f"--keep must be 0 (keep all) or more, got {args.keep}")
    pairs = [(str(k), str(v)) for k, v in args.parameter]
    # The database URL goes to the kernels through the environment, never into the report files.
    url = args.database_url
    for key, value in pairs:
        if key == "database_url":
            url = value
    params = reports.resolve_parameters(names, [(k, v) for k, v in pairs if k != "database_url"])
    # A bad value exits 2 here, before a kernel starts or a file is written.
    params = reports.check_parameters(params)
    out = Path(args.out).expanduser()
    check_directory(out, "--out")     # one line, exit 2, before a kernel starts
    results = reports.run_reports(names, params, out, database_url=url or os.environ.get("COMPOSER_DATABASE_URL"),
                                  progress=args.progress == "1", cell_timeout_s=args.timeout, jobs=args.jobs,
                                  keep=args.keep, lock_wait_s=args.lock_wait)
    failed = [r for r in results if not r.ok]
    for r in results:
        if r.ok:
            print(f"{r.notebook}: {r.html} ({r.seconds:.1f} s)")
    print(f"index: {out / 'index.html'}")
    for r in failed:
        say(r.describe_failure())
    return EXIT_FAILED if failed else EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    thresholds = health.Thresholds(**{field: getattr(args, field) for field, *_ in _THRESHOLDS}).checked()
    if args.prometheus is not None:
        if not args.prometheus.strip() or args.prometheus.endswith(os.sep):
            raise Invalid(f"--prometheus needs a file path, got {args.prometheus!r}")
        # The textfile is renamed into place from a temporary file beside it: the directory must be writable.
        check_directory(Path(args.prometheus).expanduser().absolute().parent, "--prometheus: directory")
    try:
        result = health.check_health(args.database_url, thresholds)
    except Invalid:
        raise
    except ComposerError as exc:
        # Monitoring must see that the check could not read the database, not the last good figures.
        if args.prometheus:
            health.write_prometheus_down(args.prometheus)
        if args.json:
            emit_json(health.down_json(exc))
        raise
    if args.prometheus:
        health.write_prometheus(result, args.prometheus)
    if args.json:
        emit_json(result.as_json())
    else:
        for c in result.checks:
            print(f"{'ALERT' if c.alert else 'ok':<5}  {c.name}: {_shown(c)}  {c.detail}")
            if c.alert:
                print(f"       runbook: composer-ops runbook {c.runbook}")
        print("healthy" if result.healthy else f"{sum(c.alert for c in result.checks)} check(s) alert")
    return EXIT_OK if result.healthy else EXIT_FAILED


def _shown(c: object) -> str:
    from composer_ops.ops.display import duration
    from composer_ops.ops.health import Check

    assert isinstance(c, Check)
    if c.metric.endswith("_seconds"):
        return f"{duration(c.value) or '0 s'} (alert over {duration(c.threshold)})"
    if c.metric == "composer_partitions_months_ahead":
        return f"{c.value:g} (alert below {c.threshold:g})"
    return f"{c.value:g} (alert over {c.threshold:g})"
