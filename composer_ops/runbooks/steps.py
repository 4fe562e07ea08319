"""What the runbook notebooks call beyond :mod:`composer_ops.ops`: each plan as the
CLI's dry run computes it, and each act through the engine function the CLI calls,
with the runbook's actor (so its audit rows name the record).

Plans and acts open an :class:`~composer_ops.engine.Engine` on the running database
(:func:`composer_ops.db.find_url`: never starting a server). A dry run that takes run
locks (a retry decides under the run's lock, then rolls back) cannot run as the
read-only role; its plan then lists what the selection holds and says so.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import polars as pl

from composer_ops.core.runids import add_months, month_label, month_start
from composer_ops.db import find_url
from composer_ops.errors import Invalid, PermissionDenied
from composer_ops.ops._common import RUN_TABLES, UTC_TS, Schema, Source, connection, db_now, rows_frame
from composer_ops.repo import analytics
from composer_ops.runbooks.acting import Act, actor

if TYPE_CHECKING:
    from composer_ops.engine.admin import CancelResult
    from composer_ops.engine.engine import Engine
    from composer_ops.engine.oncall import ListedCancel, SweepResult

#: What a plan says when the read-only role cannot take the locks a dry run takes.
LOCKS_NOTE = ("the read-only role cannot take the run locks this dry run takes: listed is what the selection "
              "holds; run as the operator role for the exact plan")


@contextlib.contextmanager
def engine(database_url: str | None, runbook: str) -> Iterator[Engine]:
    """An engine on the running database (never starts the embedded server)."""
    from composer_ops.engine.engine import Engine

    with Engine.connect(find_url(database_url), pool_size=1, application_name=f"runbook {runbook}") as found:
        yield found


# -- partitions ahead ------------------------------------------------------------------


def partitions_plan(source: Source, months_ahead: int) -> pl.DataFrame:
    """The partitions ``partitions ensure --months-ahead N`` would create: per run table,
    each month from the current one to N ahead that has none yet."""
    from composer_ops.ops.partitions import partition_inventory

    with connection(source) as conn:
        current = month_label(db_now(conn))
        inventory = partition_inventory(conn)
    have = set(inventory.select("table", "month").iter_rows())
    wanted = [(table, add_months(current, i)) for table in RUN_TABLES for i in range(months_ahead + 1)]
    return pl.DataFrame([(t, m, f"{t}_p{m}") for t, m in wanted if (t, m) not in have], orient="row",
                        schema={"table": pl.String, "month": pl.String, "partition": pl.String})


def partitions_act(act: Act, database_url: str | None, months_ahead: int) -> int | None:
    from composer_ops.engine import oncall

    with engine(database_url, act.runbook) as e:
        return act.run("partitions ensure", lambda: oncall.ensure_partitions(e, months_ahead,
                                                                             actor=actor(act.runbook)),
                       lambda n: f"created {n} partition(s) up to {months_ahead} month(s) ahead")


# -- expired leases: sweeper lag, a dead worker -------------------------------------------


def sweep_act(act: Act, database_url: str | None) -> SweepResult | None:
    from composer_ops.engine import oncall

    with engine(database_url, act.runbook) as e:
        return act.run("lease sweep", lambda: oncall.sweep_leases(e, actor=actor(act.runbook)),
                       lambda r: f"{r.leases_expired} expired lease(s) handled, {r.busy} run(s) busy"
                                 + (f", errors: {'; '.join(r.errors)}" if r.errors else ""))


# -- the outbox ---------------------------------------------------------------------------


def stuck_queues(backlog: pl.DataFrame, registry: pl.DataFrame, ready_age_s: float,
                 held: Sequence[str] = ()) -> pl.DataFrame:
    """Queues whose oldest ready dispatch waited more than ``ready_age_s``, with the live
    workers that serve them (0: nobody claims that queue); the ``held`` queues (paused,
    or at their limit: :func:`composer_ops.ops.active.held_queues`) left out, as the
    check leaves them."""
    live = registry.filter(pl.col("state") == "live")
    rows = []
    for queue, ready, age in backlog.select("queue", "ready", "oldest_ready_age_s").iter_rows():
        if age is None or age <= ready_age_s or queue in held:
            continue
        serving = [w for w, qs in live.select("worker", "queues").iter_rows() if queue in (qs or [])]
        rows.append((queue, ready, age, len(serving), serving))
    return pl.DataFrame(rows, orient="row", schema={
        "queue": pl.String, "ready": pl.Int64, "oldest_ready_age_s": pl.Float64, "live_workers": pl.Int64,
        "workers": pl.List(pl.String)})


# -- retention blocked -------------------------------------------------------------------


def _month_selection(month: str) -> Any:
    from composer_ops.core.selection import selection

    start = month_start(month)
    end = month_start(add_months(month, 1))
    return selection(status="RUNNING,PENDING", since=start.astimezone(UTC), until=end.astimezone(UTC))


def unblock_plan(database_url: str | None, months: Sequence[str], reason: str) -> pl.DataFrame:
    """Per blocked month, the runs ``runs cancel --since START --until END --status
    RUNNING,PENDING`` would cancel (its dry run)."""
    from composer_ops.engine.admin import cancel_runs

    rows: list[tuple[str, str, str, str | None]] = []
    with engine(database_url, "retention_blocked") as e:
        for month in months:
            result = cancel_runs(e.shell, _month_selection(month), reason=reason, yes=False)
            rows.extend((month, run_id, "cancel", None) for run_id in result.would_cancel)
            rows.extend((month, run_id, "refused", why) for run_id, why in result.would_refuse)
    return pl.DataFrame(rows, orient="row", schema={"month": pl.String, "run_id": pl.String, "action": pl.String,
                                                    "why": pl.String})


def unblock_act(act: Act, database_url: str | None, months: Sequence[str], reason: str) -> list[CancelResult]:
    from composer_ops.engine.admin import cancel_runs

    done: list[CancelResult] = []
    with engine(database_url, act.runbook) as e:
        for month in months:
            def cancel(m: str = month) -> CancelResult:
                return cancel_runs(e.shell, _month_selection(m), reason=reason, yes=True, actor=actor(act.runbook))

            result = act.run(f"runs cancel, month {month}", cancel,
                             lambda r: f"cancelled {len(r.cancelled)} run(s), skipped {len(r.skipped)}"
                                       + (f", refused {len(r.refused)}" if r.refused else ""))
            if result is not None:
                done.append(result)
    return done


# -- long waits: cancel runs named one by one ----------------------------------------------------


def _listed_frame(result: ListedCancel) -> pl.DataFrame:
    rows = [(r, "cancel", None) for r in result.cancelled] + [(r, "skip", why) for r, why in result.skipped]
    return pl.DataFrame(rows, orient="row", schema={"run_id": pl.String, "action": pl.String, "why": pl.String})


def cancel_plan(database_url: str | None, run_ids: Sequence[str], reason: str) -> tuple[pl.DataFrame, str | None]:
    """What cancelling ``run_ids`` would do (the same decisions, rolled back), and a note
    when the role cannot take the locks to decide."""
    from composer_ops.engine.oncall import cancel_listed

    if not run_ids:
        return _listed_frame(_empty_listed()), None
    with engine(database_url, "long_waits") as e:
        try:
            return _listed_frame(cancel_listed(e.shell, run_ids, reason=reason, yes=False)), None
        except PermissionDenied:
            return pl.DataFrame({"run_id": list(run_ids), "action": ["cancel if still active"] * len(run_ids),
                                 "why": [None] * len(run_ids)}, schema={
                "run_id": pl.String, "action": pl.String, "why": pl.String}), LOCKS_NOTE


def _empty_listed() -> ListedCancel:
    from composer_ops.engine.oncall import ListedCancel

    return ListedCancel(applied=False)


def cancel_act(act: Act, database_url: str | None, run_ids: Sequence[str], reason: str) -> ListedCancel | None:
    from composer_ops.engine.oncall import cancel_listed

    if not run_ids:
        if act.allowed:
            act.did.append("runs cancel: no run named in cancel_runs, nothing to cancel")
        return None
    with engine(database_url, act.runbook) as e:
        return act.run("runs cancel", lambda: cancel_listed(e.shell, run_ids, reason=reason, yes=True,
                                                            actor=actor(act.runbook)),
                       lambda r: f"cancelled {len(r.cancelled)} run(s), skipped {len(r.skipped)}")


# -- late schedules ------------------------------------------------------------------------


def late_plan(overview: pl.DataFrame) -> pl.DataFrame:
    """The late schedules, each with what would make its next slot start."""
    late = overview.filter(pl.col("late"))
    todo = [("start `composer-ops coordinator` (its schedules loop starts the overdue slots by the catch-up "
             f"policy, {catchup})" if "overdue" in (why or "") else
             "enable or redeploy the workflow" if "disabled" in (why or "") or "deleted" in (why or "") else
             "run `composer-ops partitions ensure`" if "partition" in (why or "") else
             "read the reason; `trigger` starts one run now")
            for why, catchup in late.select("late_reason", "catchup").iter_rows()]
    return late.select("name", "workflow_id", "late_reason").with_columns(pl.Series("to_do", todo, pl.String))


def trigger_act(act: Act, database_url: str | None, names: Sequence[str]) -> list[str] | None:
    """Trigger each schedule in ``names`` once (as ``schedules trigger``, audited)."""
    if not names:
        if act.allowed:
            act.did.append("schedules trigger: no schedule named in trigger, nothing to start")
        return None
    with engine(database_url, act.runbook) as e:
        return act.run("schedules trigger",
                       lambda: [e.schedules.trigger(n, actor=actor(act.runbook)) for n in names],
                       lambda started: f"started run(s) {', '.join(started)}")


# -- failing webhooks ----------------------------------------------------------------------


def failing_deliveries(source: Source, attempts: int, limit: int = 50) -> pl.DataFrame:
    """The deliveries still retried after at least ``attempts`` tries, oldest first."""
    with connection(source) as conn:
        rows = analytics.failing_deliveries(conn, attempts, limit)
    return rows_frame(rows, {"delivery": pl.Int64, "run_id": pl.String, "url": pl.String, "attempts": pl.Int64,
                             "last_status": pl.Int64, "last_error": pl.String, "next_attempt_at": UTC_TS,
                             "created_at": UTC_TS})


# -- failed runs to replay -------------------------------------------------------------------


def replay_plan(database_url: str | None, *, workflow: str | None, since: str | None, where: str | None,
                from_node: str | None, limit: int) -> tuple[pl.DataFrame, str | None]:
    """What ``runs retry --since ... [--where ...] [--from NODE]`` would do (its dry
    run), run by run; with the note when the role cannot take the run locks."""
    from composer_ops.core.selection import selection
    from composer_ops.engine.admin import retry_runs

    chosen = selection(workflow=workflow, status="FAILED", since=since, where=where)
    nodes = [from_node] if from_node else []
    with engine(database_url, "replay_failed") as e:
        try:
            bulk = retry_runs(e.shell, chosen, nodes, yes=False, limit=limit)
        except PermissionDenied:
            from composer_ops.ops.operator import find_runs

            found = find_runs(database_url, workflow=workflow, status="FAILED", since=since, where=where,
                              limit=limit).sort("created_at")
            return pl.DataFrame({"run_id": found["run_id"], "action": ["retry"] * found.height,
                                 "reset": [None] * found.height, "created": [None] * found.height,
                                 "why": [None] * found.height}, schema=_REPLAY_SCHEMA), LOCKS_NOTE
    return _replay_frame(bulk), None


_REPLAY_SCHEMA: Schema = {"run_id": pl.String, "action": pl.String, "reset": pl.List(pl.String),
                  "created": pl.List(pl.String), "why": pl.String}


def _replay_frame(bulk: Any) -> pl.DataFrame:
    rows: list[tuple[Any, ...]] = [(r.run_id, "retry", list(r.reset), list(r.created), None) for r in bulk.retried]
    rows += [(run_id, "refused", None, None, why) for run_id, why in bulk.refused]
    rows += [(run_id, "left to parent", None, None, why) for run_id, why in bulk.left_to_parent]
    return pl.DataFrame(rows, orient="row", schema=_REPLAY_SCHEMA)


def replay_act(act: Act, database_url: str | None, *, workflow: str | None, since: str | None,
               where: str | None, from_node: str | None, limit: int) -> pl.DataFrame | None:
    from composer_ops.core.selection import selection
    from composer_ops.engine.admin import retry_runs

    chosen = selection(workflow=workflow, status="FAILED", since=since, where=where)
    nodes = [from_node] if from_node else []
    with engine(database_url, act.runbook) as e:
        bulk = act.run("runs retry", lambda: retry_runs(e.shell, chosen, nodes, yes=True, limit=limit,
                                                        actor=actor(act.runbook)),
                       lambda b: f"retried {len(b.retried)} run(s), {len(b.refused)} refused, "
                                 f"{len(b.left_to_parent)} left to their parent")
    return None if bulk is None else _replay_frame(bulk)


def now_utc(source: Source) -> datetime:
    """The database clock (for the notebooks' headings)."""
    with connection(source) as conn:
        return db_now(conn)


def check_of(source: Source, alert: str, **thresholds: Any) -> Any:
    """The ``composer-ops check`` figure named ``alert``, judged with ``thresholds``
    (:class:`~composer_ops.ops.health.Thresholds` fields; the rest default)."""
    from composer_ops.ops import health

    found = health.check_health(source, health.Thresholds(**thresholds))
    return next(c for c in found.checks if c.name == alert)


def check_notice(check: Any) -> Any:
    """The check's verdict as a coloured notice (red when it alerts)."""
    import html

    from composer_ops.ops.display import notice

    verdict = "ALERT" if check.alert else "ok"
    return notice(f"<b>check {html.escape(check.name)}: {verdict}</b> ({check.value:g}, threshold "
                  f"{check.threshold:g}): {html.escape(check.detail)}", level="alert" if check.alert else "ok")


# -- a downstream service is overloaded: queue levers ----------------------------------------

#: The queue levers a runbook may pull, and what each takes.
QUEUE_ACTIONS = ("pause", "resume", "set-limit")


def _queue_change(e: Engine, queue: str, action: str, *, reason: str, max_running: int, yes: bool) -> Any:
    if action == "pause":
        return e.queues.pause(queue, reason=reason or None, yes=yes, actor=actor("downstream_overloaded"))
    if action == "resume":
        return e.queues.resume(queue, yes=yes, actor=actor("downstream_overloaded"))
    if action == "set-limit":
        return e.queues.set_limit(queue, max_running, yes=yes, actor=actor("downstream_overloaded"))
    raise Invalid(f"action must be one of {', '.join(QUEUE_ACTIONS)}, got {action!r}")


def _change_frame(changes: Sequence[Any]) -> pl.DataFrame:
    return pl.DataFrame([(c.queue, c.action, c.changed, json.dumps(c.before), json.dumps(c.after)) for c in changes],
                        schema={"queue": pl.String, "action": pl.String, "changes": pl.Boolean,
                                "before": pl.String, "after": pl.String}, orient="row")


def queue_plan(database_url: str | None, queue: str | None, action: str, *, reason: str = "",
               max_running: int = 0) -> pl.DataFrame:
    """What ``composer-ops queues ACTION QUEUE`` would change (its dry run); empty when
    no queue is named."""
    if not queue:
        return _change_frame([])
    with engine(database_url, "downstream_overloaded") as e:
        return _change_frame([_queue_change(e, queue, action, reason=reason, max_running=max_running, yes=False)])


def queue_act(act: Act, database_url: str | None, queue: str | None, action: str, *, reason: str = "",
              max_running: int = 0) -> pl.DataFrame | None:
    if not queue:
        return None
    with engine(database_url, act.runbook) as e:
        change = act.run(f"queues {action}", lambda: _queue_change(e, queue, action, reason=reason,
                                                                   max_running=max_running, yes=True),
                         lambda c: f"queue {c.queue} {json.dumps(c.before)} -> {json.dumps(c.after)}")
    return None if change is None else _change_frame([change])
