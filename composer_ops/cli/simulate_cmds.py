"""``composer-ops simulate``: deploy the simulator's workflows, backfill generated months
of past runs with COPY, and drive live traffic through real coordinator and worker processes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from composer_ops.cli._common import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    FRACTION,
    Accepts,
    above_up_to,
    add_command,
    at_least,
    between,
    env_option,
    number_text,
)
from composer_ops.core.model import TERMINAL_RUN_STATUSES
from composer_ops.errors import ComposerError, Invalid

_DESCRIPTION = """\
Fill a Composer database with a realistic workload. Four workflows are deployed
(order fulfilment with a SWITCH and joins, a nightly fan-out/fan-in batch, an
expense approval waiting for a signal with a timeout, a payment reminder with a
WAIT); an identical deployed version is reused. Then, in this order:

  months   --history-months N generated months of past runs written with COPY (N x about
           --runs-per-month runs); months already backfilled with the same seed
           are skipped, so running it twice adds nothing;
  live     --runs runs started over --duration-s seconds through real
           `composer-ops coordinator` and `composer-ops worker` processes, with
           transient and permanent failures, workers SIGKILLed mid-task, signals
           arriving early, late, too late and never, and cancellations; some runs
           are left active.

Everything random is drawn from --seed. A summary table ends the output."""


def _env_bool(env: str, default: bool) -> bool:
    value = os.environ.get(env)
    if value is None or value == "":
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    sys.stderr.write(f"composer-ops: error: {env}={value!r} is not a boolean (1/0, true/false)\n")
    raise SystemExit(EXIT_BAD_INPUT)


#: The simulator's number options, by argument group: option, type, default, the values it
#: accepts (None: :class:`~composer_ops.simulate.model.Behaviour` checks them) and help.
#: Each reads COMPOSER_SIM_<OPTION> and shows its default in --help.
_NUMBERS: tuple[tuple[str, str, type, float, Accepts | None, str], ...] = (
    ("", "--seed", int, 7, at_least(0), "seed of everything random"),
    ("live traffic", "--runs", int, 300, between(0, 1_000_000), "live runs to start"),
    ("live traffic", "--duration-s", float, 60.0, above_up_to(0, 86_400), "seconds over which they start"),
    ("live traffic", "--workers", int, 3, between(1, 32), "worker processes"),
    ("live traffic", "--concurrency", int, 8, between(1, 64), "handler slots per worker"),
    ("live traffic", "--coordinators", int, 1, between(1, 4), "coordinator processes"),
    ("live traffic", "--kill-workers", int, 2, between(0, 100),
     "workers SIGKILLed mid-task and replaced; with 2 or more the last dies as the simulation stops, leaving "
     "its leases to lapse"),
    ("live traffic", "--cancel-rate", float, 0.03, FRACTION, "share of runs cancelled"),
    ("history", "--history-months", int, 0, between(0, 120),
     "complete months before the current one to backfill, 0 for none"),
    ("history", "--runs-per-month", int, 5000, between(1, 10_000_000), "mean runs per backfilled month"),
    ("history", "--growth", float, 0.08, between(-0.5, 1.0), "month-over-month growth of the backfilled traffic"),
    ("history", "--stuck-months", int, 3, at_least(1),
     "the most recent N backfilled months keep a few stuck runs RUNNING; older ones were cancelled by an "
     "operator"),
    ("history", "--crash-rate", float, 0.003, None, "share of backfilled attempts whose worker died"),
    ("behaviour (live and history)", "--transient-rate", float, 0.05, None,
     "share of attempts failing with a retryable error"),
    ("behaviour (live and history)", "--permanent-rate", float, 0.01, None,
     "share of attempts failing with NonRetryableError"),
    ("behaviour (live and history)", "--time-scale", float, 1.0, None, "multiplies task durations, waits and timeouts"),
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = add_command(sub, "simulate", cmd_simulate,
                    help="realistic workload: generated months of past runs plus live traffic through real workers",
                    description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups: dict[str, argparse._ActionsContainer] = {"": p}
    for group, flag, kind, default, accepts, text in _NUMBERS:
        if group not in groups:
            groups[group] = p.add_argument_group(group)
            if group == "live traffic":
                groups[group].add_argument(
                    "--live", action=argparse.BooleanOptionalAction, default=_env_bool("COMPOSER_SIM_LIVE", True),
                    help="drive live traffic after the backfill [env: COMPOSER_SIM_LIVE=1|0] (default: on)")
        env_option(groups[group], flag, env="COMPOSER_SIM_" + flag[2:].upper().replace("-", "_"), type=kind,
                   default=default, accepts=accepts, help=f"{text} (default {number_text(default)})")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   default=_env_bool("COMPOSER_SIM_PROGRESS", True),
                   help="show progress bars [env: COMPOSER_SIM_PROGRESS=1|0] (default: on)")


def validate(args: argparse.Namespace) -> None:
    """One clear line (exit 2) when there is nothing to do (each option's own range is
    checked with the options, :data:`_NUMBERS`)."""
    if not (args.history_months > 0 or (args.live and args.runs > 0)):
        raise Invalid("nothing to simulate: give --history-months N, or --live with --runs N")


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from composer_ops.simulate.model import Behaviour

    validate(args)
    behaviour = Behaviour(transient_rate=args.transient_rate, permanent_rate=args.permanent_rate,
                          crash_rate=args.crash_rate, time_scale=args.time_scale)
    console = Console(highlight=False)
    return _run(args, behaviour, console)


def _progress(console: Any, enabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description:<13}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console,
                    disable=not enabled)


def _run(args: argparse.Namespace, behaviour: Any, console: Any) -> int:
    from composer_ops.core.spec import parse_spec
    from composer_ops.db.roles import check_first, require_owner
    from composer_ops.engine import Engine
    from composer_ops.repo import simulator
    from composer_ops.simulate import summary
    from composer_ops.simulate.definitions import definitions, deploy_definitions
    from composer_ops.simulate.live import PROGRESS_DEADLINE_S, LiveOptions, LiveSimulation
    from composer_ops.simulate.months import MonthsOptions, backfill

    with Engine.connect(args.database_url, pool_size=4, application_name="composer-ops simulate") as engine:
        if args.history_months:     # refused before a definition is deployed, not after
            check_first(engine.pool, require_owner, "simulate --history-months",
                        "it creates the past months' partitions")
        deployed = deploy_definitions(engine, args.time_scale)
        console.print("definitions: " + ", ".join(
            f"{wf} v{version}" + ("" if new else " (unchanged)") for wf, (version, new) in deployed.items()))
        versions = {wf: version for wf, (version, _) in deployed.items()}
        if args.history_months:
            specs = {doc["id"]: parse_spec(doc) for doc in definitions(args.time_scale)}
            options = MonthsOptions(seed=args.seed, months=args.history_months, runs_per_month=args.runs_per_month,
                                     behaviour=behaviour, growth=args.growth, stuck_months=args.stuck_months,
                                     cancel_rate=args.cancel_rate)
            with engine.pool.connection() as conn:
                now = simulator.clock(conn)
            with _progress(console, args.progress) as progress:
                bar = progress.add_task("history", total=None, detail="")
                rows = [0]

                def started(runs: int) -> None:
                    progress.update(bar, total=runs)

                def advanced(runs: int, tasks: int) -> None:
                    rows[0] += tasks
                    progress.update(bar, advance=runs, detail=f"{rows[0]:,} task rows")

                history = backfill(engine.url, specs, versions, options, now=now, on_start=started,
                                   on_progress=advanced)
            summary.render_months(console, history)
        if args.live and args.runs > 0:
            live_options = LiveOptions(seed=args.seed, runs=args.runs, duration_s=args.duration_s,
                                       behaviour=behaviour, workers=args.workers, concurrency=args.concurrency,
                                       coordinators=args.coordinators, kill_workers=args.kill_workers,
                                       cancel_rate=args.cancel_rate)
            with _progress(console, args.progress) as progress:
                bar = progress.add_task("live traffic", total=args.runs, detail="")

                def report(phase: str, f: dict[str, int]) -> None:
                    progress.update(bar, completed=f["started"], description=f"live: {phase}",
                                    detail=f"finished {f['finished']}, active {f['active']}, "
                                           f"workers killed {f['killed']}")

                result = LiveSimulation(engine, live_options, on_progress=report).run()
            figures = summary.live_figures(engine, result.run_ids, result.kills)
            summary.render_live(console, result, figures)
            if result.run_ids and sum(figures.by_status[s] for s in TERMINAL_RUN_STATUSES) == 0:
                raise ComposerError(f"no live run finished, {PROGRESS_DEADLINE_S:.0f} s after the traffic ended: "
                                    "the worker processes did not make progress"
                                    + (f" (logs under {result.log_dir})" if result.log_dir else ""))
        summary.render_database(console, summary.database_overview(engine))
    return EXIT_OK
