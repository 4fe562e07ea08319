"""``composer-ops simulate``: deploy the simulator's workflows, backfill months of
history with COPY, and drive live traffic through real coordinator and worker processes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from composer_ops.cli._common import EXIT_BAD_INPUT, EXIT_OK, add_database_option, env_option
from composer_ops.core.model import TERMINAL_RUN_STATUSES
from composer_ops.errors import ComposerError, Invalid

_DESCRIPTION = """\
Fill a Composer database with a realistic workload. Four workflows are deployed
(order fulfilment with a SWITCH and joins, a nightly fan-out/fan-in batch, an
expense approval waiting for a signal with a timeout, a payment reminder with a
WAIT); an identical deployed version is reused. Then, in this order:

  history  --history-months N past months of runs written with COPY (N x about
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


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("simulate", help="realistic workload: months of history plus live traffic through "
                       "real workers", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_option(p)
    env_option(p, "--seed", env="COMPOSER_SIM_SEED", type=int, default=7,
               help="seed of everything random (default 7)")
    live = p.add_argument_group("live traffic")
    live.add_argument("--live", action=argparse.BooleanOptionalAction, default=_env_bool("COMPOSER_SIM_LIVE", True),
                      help="drive live traffic after the backfill [env: COMPOSER_SIM_LIVE=1|0] (default: on)")
    env_option(live, "--runs", env="COMPOSER_SIM_RUNS", type=int, default=300, help="live runs to start (default 300)")
    env_option(live, "--duration-s", env="COMPOSER_SIM_DURATION_S", type=float, default=60.0,
               help="seconds over which they start (default 60)")
    env_option(live, "--workers", env="COMPOSER_SIM_WORKERS", type=int, default=3,
               help="worker processes (default 3)")
    env_option(live, "--concurrency", env="COMPOSER_SIM_CONCURRENCY", type=int, default=8,
               help="handler slots per worker (default 8)")
    env_option(live, "--coordinators", env="COMPOSER_SIM_COORDINATORS", type=int, default=1,
               help="coordinator processes (default 1)")
    env_option(live, "--kill-workers", env="COMPOSER_SIM_KILL_WORKERS", type=int, default=2,
               help="workers SIGKILLed mid-task and replaced; with 2 or more the last dies as the simulation "
                    "stops, leaving its leases to lapse (default 2)")
    env_option(live, "--cancel-rate", env="COMPOSER_SIM_CANCEL_RATE", type=float, default=0.03,
               help="share of runs cancelled (default 0.03)")
    hist = p.add_argument_group("history")
    env_option(hist, "--history-months", env="COMPOSER_SIM_HISTORY_MONTHS", type=int, default=0,
               help="complete months before the current one to backfill (default 0: none)")
    env_option(hist, "--runs-per-month", env="COMPOSER_SIM_RUNS_PER_MONTH", type=int, default=5000,
               help="mean runs per backfilled month (default 5000)")
    env_option(hist, "--growth", env="COMPOSER_SIM_GROWTH", type=float, default=0.08,
               help="month-over-month growth of the backfilled traffic (default 0.08)")
    env_option(hist, "--stuck-months", env="COMPOSER_SIM_STUCK_MONTHS", type=int, default=3,
               help="the most recent N backfilled months keep a few stuck runs RUNNING; older ones were "
                    "cancelled by an operator (default 3)")
    env_option(hist, "--crash-rate", env="COMPOSER_SIM_CRASH_RATE", type=float, default=0.003,
               help="share of backfilled attempts whose worker died (default 0.003)")
    model = p.add_argument_group("behaviour (live and history)")
    env_option(model, "--transient-rate", env="COMPOSER_SIM_TRANSIENT_RATE", type=float, default=0.05,
               help="share of attempts failing with a retryable error (default 0.05)")
    env_option(model, "--permanent-rate", env="COMPOSER_SIM_PERMANENT_RATE", type=float, default=0.01,
               help="share of attempts failing with NonRetryableError (default 0.01)")
    env_option(model, "--time-scale", env="COMPOSER_SIM_TIME_SCALE", type=float, default=1.0,
               help="multiplies task durations, waits and timeouts (default 1)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   default=_env_bool("COMPOSER_SIM_PROGRESS", True),
                   help="show progress bars [env: COMPOSER_SIM_PROGRESS=1|0] (default: on)")
    p.set_defaults(func=cmd_simulate)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise Invalid(message)


def validate(args: argparse.Namespace) -> None:
    """One clear line (exit 2) for an option out of range."""
    _check(args.seed >= 0, f"--seed must be 0 or more, got {args.seed}")
    _check(0 <= args.history_months <= 120, f"--history-months must be between 0 and 120, got {args.history_months}")
    _check(1 <= args.runs_per_month <= 10_000_000,
           f"--runs-per-month must be between 1 and 10000000, got {args.runs_per_month}")
    _check(-0.5 <= args.growth <= 1.0, f"--growth must be between -0.5 and 1, got {args.growth}")
    _check(args.stuck_months >= 1, f"--stuck-months must be 1 or more, got {args.stuck_months}")
    _check(0 <= args.runs <= 1_000_000, f"--runs must be between 0 and 1000000, got {args.runs}")
    _check(0 < args.duration_s <= 86_400, f"--duration-s must be more than 0 and at most 86400, got {args.duration_s}")
    _check(1 <= args.workers <= 32, f"--workers must be between 1 and 32, got {args.workers}")
    _check(1 <= args.concurrency <= 64, f"--concurrency must be between 1 and 64, got {args.concurrency}")
    _check(1 <= args.coordinators <= 4, f"--coordinators must be between 1 and 4, got {args.coordinators}")
    _check(0 <= args.kill_workers <= 100, f"--kill-workers must be between 0 and 100, got {args.kill_workers}")
    _check(0 <= args.cancel_rate < 1, f"--cancel-rate must be a fraction in [0, 1), got {args.cancel_rate}")
    _check(args.history_months > 0 or (args.live and args.runs > 0),
           "nothing to simulate: give --history-months N, or --live with --runs N")


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
    from composer_ops.engine import Engine
    from composer_ops.repo import simulator
    from composer_ops.simulate import summary
    from composer_ops.simulate.definitions import definitions, deploy_definitions
    from composer_ops.simulate.history import HistoryOptions, backfill
    from composer_ops.simulate.live import LiveOptions, LiveSimulation

    with Engine.connect(args.database_url, pool_size=4, application_name="composer-ops simulate") as engine:
        deployed = deploy_definitions(engine, args.time_scale)
        console.print("definitions: " + ", ".join(
            f"{wf} v{version}" + ("" if new else " (unchanged)") for wf, (version, new) in deployed.items()))
        versions = {wf: version for wf, (version, _) in deployed.items()}
        if args.history_months:
            specs = {doc["id"]: parse_spec(doc) for doc in definitions(args.time_scale)}
            options = HistoryOptions(seed=args.seed, months=args.history_months, runs_per_month=args.runs_per_month,
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
            summary.render_history(console, history)
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
                raise ComposerError("no live run finished: the worker processes did not make progress"
                                    + (f" (logs under {result.log_dir})" if result.log_dir else ""))
        summary.render_database(console, summary.database_overview(engine))
    return EXIT_OK
