"""The simulator's end-of-run summary: figures read back from the database, as tables.

Live figures are computed over the run IDs the live phase started (each query filters
on ``run_id = ANY(...)``, so only the current month's partitions are touched); the
database overview counts runs per partition month and status.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from composer_ops.core.model import RunStatus
from composer_ops.repo import simulator

if TYPE_CHECKING:
    from composer_ops.engine import Engine
    from composer_ops.simulate.live import HeldTask, LiveResult
    from composer_ops.simulate.months import MonthsResult

__all__ = ["LiveFigures", "database_overview", "live_figures", "render_database", "render_months",
           "render_live"]

LEASE_ERROR = "lease of % expired at %"


@dataclass
class LiveFigures:
    """What the live runs left in the database."""

    by_status: Counter[str] = field(default_factory=Counter)
    tasks_by_type: Counter[str] = field(default_factory=Counter)
    tasks_by_state: Counter[str] = field(default_factory=Counter)
    retried_tasks: int = 0
    retries: int = 0
    expired_leases: int = 0
    lease_errors: int = 0
    running_with_lease: int = 0
    signals_buffered: int = 0
    signals_consumed: int = 0
    outbox: int = 0


def live_figures(engine: Engine, run_ids: Sequence[str],
                 killed: Sequence[tuple[str, Sequence[HeldTask]]] = ()) -> LiveFigures:
    """Figures of the live runs. ``killed``: the workers SIGKILLed and the tasks they
    held; a held task counts as an expired lease when its attempt moved on (the
    sweeper re-queued it), whatever happened to it afterwards."""
    figures = LiveFigures()
    if not run_ids:
        return figures
    held = [(t.run_id, t.task_id, t.attempt) for _, tasks in killed for t in tasks]
    with engine.pool.connection() as conn:
        by_status, tasks = simulator.live_counts(conn, run_ids, LEASE_ERROR)
        figures.signals_buffered, figures.signals_consumed, figures.outbox = simulator.signal_counts(conn, run_ids)
        figures.expired_leases = simulator.moved_attempts(conn, held)
    for status, n in by_status:
        figures.by_status[status] = n
    for node_type, state, n, retried, retries, leases, running in tasks:
        figures.tasks_by_type[node_type] += n
        figures.tasks_by_state[state] += n
        figures.retried_tasks += retried
        figures.retries += retries
        figures.lease_errors += leases
        figures.running_with_lease += running
    return figures


def database_overview(engine: Engine) -> list[tuple[str, str, int]]:
    """Runs per partition month and status: ``(YYYYMM, status, runs)``."""
    with engine.pool.connection() as conn:
        return simulator.runs_per_month(conn)


def _fmt(n: float) -> str:
    return f"{n:,.0f}"


def render_months(console: Console, result: MonthsResult) -> None:
    table = Table(title="Generated months", title_justify="left")
    for name in ("month", "runs", "task rows", "signals", "active runs", ""):
        table.add_column(name, justify="right" if name not in ("month", "") else "left")
    for m in result.months:
        if m.skipped:
            table.add_row(m.month, "", "", "", "", "already backfilled with this seed: skipped")
        else:
            table.add_row(m.month, _fmt(m.runs), _fmt(m.tasks), _fmt(m.signals), _fmt(m.active_runs), "written")
    console.print(table)
    if result.tasks:
        console.print(f"backfill: {_fmt(result.rows)} rows ({_fmt(result.tasks)} task rows) in "
                      f"{result.seconds:.1f} s: [bold]{_fmt(result.task_rows_per_s)} task rows/s[/bold] "
                      f"({_fmt(result.task_rows_per_s * 60)} per minute); foreign keys checked "
                      + ("per chunk, in bulk" if result.set_based_checks else "per row, by their triggers"))


def render_live(console: Console, result: LiveResult, figures: LiveFigures) -> None:
    table = Table(title="Live traffic", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("detail")
    started = len(result.run_ids)
    rate = started / result.seconds if result.seconds else 0.0
    planned = started + len(result.start_failures)
    table.add_row("runs started", _fmt(started), f"of {planned} planned, {rate:.1f}/s over {result.seconds:.0f} s"
                  + (f", {result.start_retries} retried after a transient error" if result.start_retries else ""))
    if result.start_failures:
        table.add_row("  not started", _fmt(len(result.start_failures)), "the database refused them (below)")
    if result.progress_wait_s >= 1.0:
        table.add_row("  waited", f"{result.progress_wait_s:.0f} s",
                      "after the traffic, until a first run finished (a loaded machine)")
    for status in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.RUNNING):
        note = "left active" if status is RunStatus.RUNNING else ""
        table.add_row(f"  {status.lower()}", _fmt(figures.by_status.get(status, 0)), note)
    tasks = sum(figures.tasks_by_state.values())
    table.add_row("tasks", _fmt(tasks), _counts(figures.tasks_by_type))
    table.add_row("  by state", "", _counts(figures.tasks_by_state))
    table.add_row("retries", _fmt(figures.retries), f"{figures.retried_tasks} tasks needed more than one attempt")
    held = sum(len(tasks) for _, tasks in result.kills)
    table.add_row("expired leases", _fmt(figures.expired_leases),
                  f"of the {held} tasks killed workers held, retried after their lease lapsed; "
                  f"{figures.lease_errors} tasks' last error is a lapsed lease")
    killed = ", ".join(f"{owner} ({len(held)} running)" for owner, held in result.kills) or "none"
    table.add_row("workers killed", _fmt(len(result.kills)), killed)
    if figures.running_with_lease:
        table.add_row("  tasks left RUNNING", _fmt(figures.running_with_lease), "leased to a worker that is gone")
    table.add_row("signals buffered", _fmt(figures.signals_buffered),
                  f"{figures.signals_consumed} consumed when their node was created, "
                  f"{figures.signals_buffered - figures.signals_consumed} still pending")
    table.add_row("signals sent", _fmt(sum(v for k, v in result.signals.items() if k != "never sent")),
                  _counts(result.signals))
    table.add_row("cancellations", _fmt(sum(result.cancels.values())), _counts(result.cancels))
    table.add_row("outbox backlog", _fmt(figures.outbox), "dispatches waiting for a worker")
    console.print(table)
    for failure in result.start_failures:
        console.print(f"[yellow]warning:[/yellow] planned run live-{failure.index} ({failure.workflow_id}) "
                      f"not started: {failure.error}")
    for line in result.unexpected_exits:
        console.print(f"[yellow]warning:[/yellow] {line}")
    if result.log_dir:
        console.print(f"process logs kept under {result.log_dir}")


def render_database(console: Console, rows: Sequence[tuple[str, str, int]]) -> None:
    statuses = sorted({s for _, s, _ in rows})
    table = Table(title="Runs in the database, by partition month", title_justify="left")
    table.add_column("month")
    for status in statuses:
        table.add_column(status.lower(), justify="right")
    by_month: dict[str, dict[str, int]] = {}
    for month, status, n in rows:
        by_month.setdefault(month, {})[status] = n
    for month, counts in by_month.items():
        table.add_row(month, *[_fmt(counts.get(s, 0)) for s in statuses])
    console.print(table)


def _counts(counter: Counter[str] | dict[str, Any]) -> str:
    return ", ".join(f"{k.lower() if k.isupper() else k} {v}" for k, v in sorted(counter.items()) if v)
