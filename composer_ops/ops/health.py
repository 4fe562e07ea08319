"""Deployment health in one read: the figures ``composer-ops check`` judges against
thresholds, for cron and monitoring.

Every figure comes from the same read-only functions the reports use, in one
snapshot; each check says what it measured, the threshold, and whether it alerts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import polars as pl

from composer_ops.errors import Invalid
from composer_ops.ops import active, leases, params, partitions, retention, schedules
from composer_ops.ops._common import Source, connection, db_now, read_from
from composer_ops.ops.display import duration
from composer_ops.repo import analytics
from composer_ops.repo._base import set_read_timeouts


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """When each check alerts (the CLI's options; defaults suit a deployment whose
    coordinator sweeps every few seconds and keeps six months)."""

    months_ahead_min: int = 2          # alert below this many partition months after the current one
    sweeper_lag_s: float = 60          # alert when a lease expired longer ago than this and is still RUNNING
    replay_lag_s: float = 60           # on a hot standby: alert when its replay lags more than this
    outbox_ready_age_s: float = 300    # alert when a claimable dispatch waited longer than this
    retention_older_than: str = "6 months"  # the cut-off retention is judged at
    long_wait_h: float = 24            # alert on WAIT_FOR_SIGNAL nodes without a timeout waiting longer
    webhook_attempts: int = 3          # a delivery still retried after this many attempts is failing
    schedule_late_s: float = 300       # alert on a schedule whose last due slot did not start this long after it
    queue_paused_h: float = 1          # alert on a queue paused longer than this (an incident's pause forgotten)
    timers_overdue_s: float = 60       # alert when a WAITING task's timer (wake_at) passed longer ago than this

    def checked(self) -> Thresholds:
        """Itself, or :class:`Invalid` naming the first threshold out of range."""
        if self.months_ahead_min < 0:
            raise Invalid(f"--months-ahead-min must be 0 or more, got {self.months_ahead_min}")
        for name, value, unit in (("--sweeper-lag", self.sweeper_lag_s, "s"), ("--replay-lag", self.replay_lag_s, "s"),
                                  ("--outbox-ready-age", self.outbox_ready_age_s, "s"),
                                  ("--long-wait-h", self.long_wait_h, "h"),
                                  ("--schedule-late", self.schedule_late_s, "s"),
                                  ("--queue-paused-h", self.queue_paused_h, "h"),
                                  ("--timers-overdue", self.timers_overdue_s, "s")):
            try:
                params.number(value, unit=unit)
            except Invalid as exc:
                raise Invalid(f"{name} {exc}") from None
        if self.webhook_attempts < 1:
            raise Invalid(f"--webhook-attempts must be 1 or more, got {self.webhook_attempts}")
        retention.parse_cutoff(self.retention_older_than)
        return self


@dataclass(frozen=True, kw_only=True)
class Check:
    """One health figure: ``metric`` is its Prometheus name, ``value`` the figure,
    ``alert`` whether it crossed ``threshold``."""

    name: str
    metric: str
    value: float
    threshold: float
    alert: bool
    detail: str
    help: str
    runbook: str                       # the runbook notebook for this alert (``composer-ops runbook NAME``)


@dataclass(frozen=True, kw_only=True)
class Health:
    checked_at: datetime
    checks: list[Check]
    queues: list[dict[str, Any]] = field(default_factory=list)   # per queue: active.queue_overview's rows
    keys_at_limit: int = 0             # concurrency keys at their limit with tasks ready behind them
    odd_leases: int = 0                # RUNNING tasks without a lease or with an infinite one (odd data)

    @property
    def healthy(self) -> bool:
        return not any(c.alert for c in self.checks)

    def as_json(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "up": True, "checked_at": self.checked_at.isoformat().replace("+00:00", "Z"),
                "checks": [asdict(c) for c in self.checks], "queues": self.queues,
                "keys_at_limit": self.keys_at_limit, "odd_leases": self.odd_leases}


#: A check's reads give up on a lock wait, and a statement, after these many seconds
#: (when it opens its own connection): run from cron every minute, a check behind an
#: operator's lock would otherwise wait with every later one.
CHECK_LOCK_TIMEOUT_S = 10.0
CHECK_STATEMENT_TIMEOUT_S = 60.0


def check_health(source: Source = None, thresholds: Thresholds | None = None) -> Health:
    """Read every figure in one snapshot and judge it (see :class:`Thresholds`); on its
    own connection, within :data:`CHECK_LOCK_TIMEOUT_S` per lock wait and
    :data:`CHECK_STATEMENT_TIMEOUT_S` per statement."""
    t = (thresholds or Thresholds()).checked()
    cutoff = retention.parse_cutoff(t.retention_older_than)
    with connection(source, application_name="composer-ops check", lock_wait_s=CHECK_LOCK_TIMEOUT_S) as conn:
        if conn is not source:
            set_read_timeouts(conn, lock_s=CHECK_LOCK_TIMEOUT_S, statement_s=CHECK_STATEMENT_TIMEOUT_S)
        now = db_now(conn)
        reading = read_from(conn)
        ahead = partitions.lookahead(conn, minimum=t.months_ahead_min)
        running = leases.running_leases(conn)
        timers, timers_due, timers_late = active.timers_overdue(conn, older_than_s=t.timers_overdue_s, limit=1)
        starts, starts_due, starts_late = active.starts_overdue(conn, older_than_s=t.timers_overdue_s, limit=1)
        backlog = active.outbox_backlog(conn)
        plan = retention.retention_plan(conn, cutoff)
        waits, waits_total = active.long_waits(conn, older_than_s=t.long_wait_h * 3600, limit=1)
        failing, most_attempts, _ = analytics.webhooks_failing(conn, t.webhook_attempts)
        timetable = schedules.schedules_overview(conn, late_after_s=t.schedule_late_s)
        queue_rows = active.queue_overview(conn)
        at_limit = active.keys_at_limit(conn)
    checks: list[Check] = []

    # Read first: every other figure is as old as the replay position of a standby.
    replay = reading.replay_lag_s if reading.replay_lag_s is not None else 0.0
    streaming = reading.wal_receiver in ("streaming", "running")
    checks.append(Check(
        name="replay lag", runbook="replay_lag",
        metric="composer_replay_lag_seconds", value=replay, threshold=t.replay_lag_s,
        alert=reading.standby and (replay > t.replay_lag_s or not streaming),
        detail=("a primary: nothing to replay" if not reading.standby else
                f"a hot standby, {duration(replay)} behind; WAL receiver {reading.wal_receiver or 'not running'}"
                + ("" if streaming else ": it does not follow the primary")),
        help="Seconds a hot standby's replay lags the primary (0 on a primary, or caught up)."))

    fewest = min(ahead["months_ahead"].to_list()) if ahead["has_current"].all() else -1
    short = ahead.filter(pl.col("alert"))["table"].to_list()
    checks.append(Check(
        name="partition months ahead", runbook="partitions_ahead",
        metric="composer_partitions_months_ahead", value=fewest,
        threshold=t.months_ahead_min, alert=bool(ahead["alert"].any()),
        detail=(f"{', '.join(short)} short: run composer-ops partitions ensure --months-ahead 3" if short
                else f"every table has {fewest} months after {ahead['current_month'][0]}"),
        help="Fewest partition months after the current UTC month over the run tables (-1: current missing)."))

    # A lease at '-infinity' (odd data) is expired but has no lag to measure: it is
    # counted with the odd leases instead.
    expired = leases.expired_running(leases=running).filter(pl.col("overdue_s").is_finite())
    odd = leases.without_lease(running)
    lag = max(expired["overdue_s"].to_list(), default=0.0)
    checks.append(Check(
        name="sweeper lag", runbook="sweeper_lag",
        metric="composer_sweeper_lag_seconds", value=lag, threshold=t.sweeper_lag_s,
        alert=lag > t.sweeper_lag_s,
        detail=(f"{expired.height} RUNNING task(s) with an expired lease, the oldest {duration(lag)} ago: "
                "is a coordinator running?" if expired.height else "no expired lease is still RUNNING")
               + (f"; odd data: {odd.height} RUNNING task(s) without a lease or with an infinite one, e.g. run "
                  f"{odd['run_id'][0]} (the lease_expiries report lists them)" if odd.height else ""),
        help="Seconds since the longest-expired lease of a task still RUNNING (0: none)."))

    # The coordinator's timer loop fires a due timer, and fails a dispatch past its
    # schedule_to_start deadline, within a pass: one still there past the threshold
    # means no coordinator runs, even while workers do.
    timer_s = float(timers["overdue_s"][0]) if timers.height else 0.0
    start_s = float(starts["overdue_s"][0]) if starts.height else 0.0
    overdue = max(timer_s, start_s)
    over = duration(t.timers_overdue_s)
    late_parts = ([f"{timers_late} WAITING task(s) whose timer passed over {over} ago, the oldest "
                   f"{duration(timer_s)} overdue in run {timers['run_id'][0]} (node {timers['node_id'][0]})"]
                  if timer_s > t.timers_overdue_s else []) + \
                 ([f"{starts_late} dispatch(es) past their schedule_to_start deadline by over {over}, the oldest "
                   f"{duration(start_s)} in run {starts['run_id'][0]}"] if start_s > t.timers_overdue_s else [])
    checks.append(Check(
        name="timers overdue", runbook="timers_overdue",
        metric="composer_timers_overdue_seconds", value=overdue, threshold=t.timers_overdue_s,
        alert=overdue > t.timers_overdue_s,
        detail=("; ".join(late_parts) + ": is a coordinator running?" if late_parts
                else f"{timers_due} timer(s) due, none overdue over {over}"
                     + (f"; {starts_due} dispatch(es) past their schedule_to_start deadline, none by over {over}"
                        if starts_due else "")),
        help="Seconds the most overdue timer of an active run (a WAIT node's timer, a WAIT_FOR_SIGNAL node's "
             "timeout) is past its wake_at and still WAITING, or a dispatch past its schedule_to_start deadline "
             "is still in the outbox: both are the coordinator's to fire (0: none due)."))

    # A paused queue's rows, or those of a queue at its limit, wait on purpose: the
    # queue's own check (queue paused long) and the queues' figures speak for them.
    held = active.held_queues(queue_rows)
    claimable = backlog.filter(~pl.col("queue").is_in(held))
    waiting = backlog.filter(pl.col("queue").is_in(held) & (pl.col("ready") > 0))
    held_ready = int(waiting["ready"].sum())
    ready = max(claimable["oldest_ready_age_s"].drop_nulls().to_list(), default=0.0)
    stuck = claimable.filter(pl.col("oldest_ready_age_s") > t.outbox_ready_age_s)["queue"].to_list()
    checks.append(Check(
        name="oldest ready outbox row", runbook="outbox_ready",
        metric="composer_outbox_oldest_ready_seconds", value=ready,
        threshold=t.outbox_ready_age_s, alert=ready > t.outbox_ready_age_s,
        detail=(f"no worker claims queue(s) {', '.join(stuck)}" if stuck
                else f"{int(claimable['ready'].sum()) if claimable.height else 0} ready dispatch(es), "
                     "none waiting long")
               + (f"; not counted: {held_ready} ready in queue(s) {', '.join(waiting['queue'].to_list())}, "
                  "paused or at their limit"
                  if held_ready else ""),
        help="Seconds the oldest claimable dispatch has waited in the outbox (0: none); the rows of a paused "
             "queue or of one at its max_running are not counted."))

    blocked = plan.filter(pl.col("reason").is_in(["has active runs", "has live children"]))
    runs = [r for ids in blocked["active_run_ids"].to_list() for r in ids]
    checks.append(Check(
        name="retention blocked", runbook="retention_blocked",
        metric="composer_retention_blocked_months", value=blocked.height, threshold=0,
        alert=blocked.height > 0,
        detail=(f"month(s) {', '.join(blocked['month'].to_list())} past {cutoff.text} kept for active runs, e.g. "
                f"{', '.join(runs[:3])}" if blocked.height else f"nothing past {cutoff.text} is kept for active runs"),
        help="Partition months past the retention cut-off kept because they hold RUNNING or PENDING runs."))

    checks.append(Check(
        name="long waits without timeout", runbook="long_waits",
        metric="composer_long_waits_without_timeout", value=waits_total,
        threshold=0, alert=waits_total > 0,
        detail=(f"{waits_total} WAIT_FOR_SIGNAL node(s) without a timeout waiting over {t.long_wait_h:g} h, "
                f"the oldest in run {waits['run_id'][0]}" if waits_total
                else f"none waiting over {t.long_wait_h:g} h"),
        help="WAIT_FOR_SIGNAL nodes without a timeout that have waited longer than the threshold."))

    checks.append(Check(
        name="failing webhooks", runbook="failing_webhooks",
        metric="composer_webhook_deliveries_failing", value=int(failing), threshold=0,
        alert=int(failing) > 0,
        detail=(f"{failing} delivery(ies) still retried after {t.webhook_attempts}+ attempts (up to "
                f"{most_attempts}): is the endpoint up?" if failing else "no delivery is failing"),
        help="Webhook deliveries not delivered after at least the threshold's attempts and still retried."))

    late = timetable.filter(pl.col("late"))
    checks.append(Check(
        name="late schedules", runbook="schedule_late",
        metric="composer_schedules_late", value=late.height, threshold=0, alert=late.height > 0,
        detail=(f"{late.height} schedule(s) whose last due slot did not start, e.g. {late['name'][0]}: "
                f"{late['late_reason'][0]}" if late.height
                else f"every due slot of {timetable.height} schedule(s) started or was skipped by its policy"),
        help="Schedules whose last due slot did not start: overdue past the threshold, or missed."))
    paused = queue_rows.filter(pl.col("paused"))
    longest = max((s for s in paused["paused_s"].to_list() if s is not None), default=0.0)
    long_paused = paused.filter(pl.col("paused_s") > t.queue_paused_h * 3600)
    checks.append(Check(
        name="queue paused long", runbook="downstream_overloaded",
        metric="composer_queue_paused_longest_seconds", value=longest, threshold=t.queue_paused_h * 3600,
        alert=long_paused.height > 0,
        detail=(f"queue(s) {', '.join(long_paused['queue'].to_list())} paused over {t.queue_paused_h:g} h "
                "(composer-ops queues resume NAME --yes once the downstream service is back)" if long_paused.height
                else f"{paused.height} queue(s) paused, none over {t.queue_paused_h:g} h"),
        help="Seconds the longest-paused queue has been paused (0: none paused)."))
    return Health(checked_at=now, checks=checks, keys_at_limit=at_limit.height, odd_leases=odd.height, queues=[
        {k: (v.isoformat().replace("+00:00", "Z") if isinstance(v, datetime) else v) for k, v in row.items()}
        for row in queue_rows.to_dicts()])


def write_prometheus(health: Health, path: str) -> None:
    """The checks in the Prometheus text format, written atomically (a temporary file
    renamed over ``path``), for node_exporter's textfile collector. Each check's alert
    gauge names its runbook (the ``runbook`` label)."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    for check in health.checks:
        Gauge(check.metric, check.help, registry=registry).set(check.value)
    alert = Gauge("composer_check_alert", "1 when the check crossed its threshold; runbook: composer-ops runbook "
                  "NAME.", ["check", "runbook"], registry=registry)
    limit = Gauge("composer_check_threshold", "The threshold the check alerts beyond.", ["check"], registry=registry)
    for check in health.checks:
        alert.labels(check=check.metric, runbook=check.runbook).set(1 if check.alert else 0)
        limit.labels(check=check.metric).set(check.threshold)
    _up(registry, 1)
    Gauge("composer_check_healthy", "1 when no check alerts.", registry=registry).set(1 if health.healthy else 0)
    _queue_gauges(registry, health.queues)
    Gauge("composer_concurrency_keys_at_limit", "Concurrency keys with as many attempts RUNNING as their limit "
          "and tasks ready behind them.", registry=registry).set(health.keys_at_limit)
    Gauge("composer_running_odd_leases", "RUNNING tasks without a lease or with one at 'infinity' or '-infinity' "
          "(odd data: the lease_expiries report lists them).", registry=registry).set(health.odd_leases)
    Gauge("composer_check_timestamp_seconds", "When the checks read the database (its clock).",
          registry=registry).set(health.checked_at.timestamp())
    _write(registry, path)


#: Per-queue figures of ``check --prometheus``: (metric, help, the queue row's field).
_QUEUE_GAUGES = (
    ("composer_queue_depth", "Dispatches of the queue waiting in the outbox, ready or delayed.", "depth"),
    ("composer_queue_ready", "Dispatches of the queue a worker could claim now.", "ready"),
    ("composer_queue_oldest_ready_seconds", "Seconds the queue's oldest claimable dispatch has waited (0: none).",
     "oldest_ready_s"),
    ("composer_queue_running", "Tasks of the queue RUNNING.", "running"),
    ("composer_queue_paused", "1 when an operator paused the queue (composer-ops queues pause).", "paused"),
    ("composer_queue_max_running", "The queue's limit of RUNNING tasks (0: none).", "max_running"),
    ("composer_queue_at_limit", "1 when the queue has as many RUNNING tasks as its limit allows.", "at_limit"),
)


def _queue_gauges(registry: Any, rows: list[dict[str, Any]]) -> None:
    from prometheus_client import Gauge

    for metric, text, key in _QUEUE_GAUGES:
        gauge = Gauge(metric, text, ["queue"], registry=registry)
        for row in rows:
            gauge.labels(queue=row["queue"]).set(float(row[key] or 0))


def write_prometheus_down(path: str) -> None:
    """What the textfile says when the database could not be read: ``composer_check_up``
    0 and ``composer_check_healthy`` 0, so the figures of the last good run are not
    taken for current ones."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    _up(registry, 0)
    Gauge("composer_check_healthy", "1 when no check alerts.", registry=registry).set(0)
    _write(registry, path)


def down_json(error: Exception) -> dict[str, Any]:
    """``check --json`` when the database could not be read; ``kind`` as the CLI's
    one-line error names it (``unavailable``, ``permissiondenied``, ...)."""
    from composer_ops.errors import Unavailable

    kind = "unavailable" if isinstance(error, Unavailable) else type(error).__name__.lower()
    return {"healthy": False, "up": False, "checked_at": None, "checks": [],
            "error": {"kind": kind, "message": str(error)}}


def _up(registry: Any, value: int) -> None:
    from prometheus_client import Gauge

    Gauge("composer_check_up", "1 when check could read the database, 0 when it could not (then every other "
          "figure is absent).", registry=registry).set(value)


def _write(registry: Any, path: str) -> None:
    from prometheus_client import write_to_textfile

    try:
        write_to_textfile(path, registry)
    except OSError as exc:
        raise Invalid(f"--prometheus {path}: cannot write there ({exc.strerror or exc})") from None
