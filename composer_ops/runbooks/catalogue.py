"""The runbooks: one notebook per ``composer-ops check`` alert and per incident of
docs/operations.md, each in three parts: diagnose (read-only), plan (what the CLI's
dry run would do), act (only with ``confirm=True``, through the engine, audited).

The notebooks ship under ``notebooks/runbooks/`` (package data, beside the report
notebooks); this module names them, says what each serves and what its act does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from composer_ops.errors import ComposerError, NotFound

#: The folder of the runbook notebooks inside the notebooks directory, and of their records under reports/.
FOLDER = "runbooks"


@dataclass(frozen=True, kw_only=True)
class Runbook:
    """One runbook: its notebook's name, the ``check`` alert (the check's name) or the
    incident it serves, and what acting does."""

    name: str
    alert: str | None
    incident: str | None
    means: str
    acts: str

    @property
    def serves(self) -> str:
        return f"check alert: {self.alert}" if self.alert else f"incident: {self.incident}"

    @property
    def reads_only(self) -> bool:
        """Whether acting does nothing (``acts`` says ``nothing: ...`` and why)."""
        return self.acts.startswith("nothing:")


RUNBOOKS: tuple[Runbook, ...] = (
    Runbook(name="replay_lag", alert="replay lag", incident=None,
            means="a hot standby replays the primary's WAL late, or not at all",
            acts="nothing: replication is the server's; the runbook says what to look at there"),
    Runbook(name="partitions_ahead", alert="partition months ahead", incident=None,
            means="fewer partition months exist after the current one than the minimum: starts fail at the "
                  "month boundary without them",
            acts="creates the missing months (as `partitions ensure`), one audit row"),
    Runbook(name="sweeper_lag", alert="sweeper lag", incident=None,
            means="a task is still RUNNING long after its lease expired: no coordinator sweeps leases",
            acts="runs one pass of the lease sweeper (as a coordinator would), one audit row"),
    Runbook(name="timers_overdue", alert="timers overdue", incident="the coordinator is down",
            means="a WAITING task's timer (a WAIT node, a WAIT_FOR_SIGNAL timeout) or a dispatch's "
                  "schedule_to_start deadline passed long ago and did not fire: no coordinator runs the timer loop",
            acts="nothing: start a coordinator; the runbook lists the timers it will fire"),
    Runbook(name="outbox_ready", alert="oldest ready outbox row", incident=None,
            means="a claimable dispatch has waited too long: no live worker serves its queue, or too few",
            acts="nothing: start or scale workers for the queues named; the runbook names them"),
    Runbook(name="retention_blocked", alert="retention blocked", incident="stuck retention",
            means="partition months past the retention cut-off are kept because runs in them are still active",
            acts="cancels the active runs of the blocked months (as `runs cancel --yes`), audited per chunk"),
    Runbook(name="long_waits", alert="long waits without timeout", incident=None,
            means="WAIT_FOR_SIGNAL nodes without a timeout have waited longer than the threshold",
            acts="cancels the runs named in `cancel_runs` (none by default), one audit row"),
    Runbook(name="failing_webhooks", alert="failing webhooks", incident=None,
            means="webhook deliveries are still retried after many attempts: the endpoint refuses or is down",
            acts="nothing: the relay retries by itself once the endpoint answers; the runbook names them"),
    Runbook(name="schedule_late", alert="late schedules", incident="a schedule did not fire",
            means="a schedule's last due slot did not start: no coordinator runs the schedules loop, or its run "
                  "could not start (workflow disabled or deleted, no partition for the slot's month)",
            acts="triggers the schedules named in `trigger` (none by default), one run each, audited as "
                 "`schedules trigger`"),
    Runbook(name="dead_worker", alert=None, incident="a dead worker",
            means="a worker stopped without a clean stop and may hold leases of RUNNING tasks",
            acts="runs one pass of the lease sweeper for the leases that expired, one audit row"),
    Runbook(name="replay_failed", alert=None, incident="failed runs to replay",
            means="runs FAILED (a downstream outage) and should run again from the node that failed",
            acts="retries the selected runs (as `runs retry --yes`), one audit row per run"),
    Runbook(name="downstream_overloaded", alert="queue paused long", incident="a downstream service is overloaded",
            means="a service the tasks of a queue call is overloaded: pause the queue or limit its running tasks; "
                  "the alert says a queue has stayed paused past the threshold",
            acts="pauses, resumes or limits the queue named (as `queues pause|resume|set-limit --yes`), "
                 "one audit row"),
    Runbook(name="find_run", alert=None, incident="a run to find by its input",
            means="someone asks about an order or a customer: find the runs by their input and show one",
            acts="nothing: it only reads"),
)


def names() -> list[str]:
    return [r.name for r in RUNBOOKS]


def get(name: str) -> Runbook:
    for r in RUNBOOKS:
        if r.name == name:
            return r
    raise NotFound(f"unknown runbook {name!r}; available: {', '.join(names())} (composer-ops runbook list)")


def runbook_of_alert(alert: str) -> Runbook:
    """The runbook of the ``check`` alert named ``alert``."""
    for r in RUNBOOKS:
        if r.alert == alert:
            return r
    raise NotFound(f"no runbook serves the check alert {alert!r}")


def notebooks_dir() -> Path:
    """Where the runbook notebooks are: ``runbooks/`` in the notebooks directory."""
    from composer_ops.reports import notebooks_dir as reports_dir

    found = reports_dir() / FOLDER
    if not found.is_dir():
        raise ComposerError(f"runbook notebooks directory {found} does not exist")
    return found
