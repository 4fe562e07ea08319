"""The coordinator's background loops (``composer-ops coordinator``).

Timers (due WAIT and WAIT_FOR_SIGNAL tasks) and the lease sweeper read only the months
from the active floor on (the oldest run with an active task); partition upkeep ensures
months ahead hourly; the webhook relay POSTs and prunes deliveries; retention
(optional) follows the CLI's plan; the schedules loop starts the due slots of the
schedules whose wake-up has come (:mod:`composer_ops.engine.schedules`); the children
loop delivers, on Citus, the SUB_WORKFLOW rows no engine delivered
(:mod:`composer_ops.engine.childrows`). Every timer
and lease decision goes through the shell under the run lock and re-checks its
candidate there, and a schedule is decided under its row lock, so any number of
coordinators can run at once: what two of them find is applied by one and stale for
the other.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from composer_ops.core import runids
from composer_ops.core.actor import Actor
from composer_ops.core.cutoff import Cutoff, parse_cutoff
from composer_ops.core.model import Event, LeaseExpired, StartTimedOut, TaskRef, TimerDue
from composer_ops.db import autocommit, roles
from composer_ops.db.errors import TranslatingPool
from composer_ops.db.retry import db_retry
from composer_ops.engine import childrows
from composer_ops.engine.retention import drop_due_months
from composer_ops.engine.shell import Outcome
from composer_ops.engine.webhooks import RelayPolicy, relay_once
from composer_ops.errors import ComposerError, Invalid, LockTimeout, Transient, Unavailable
from composer_ops.repo import (
    citus_flow,
    citus_scan,
    clock,
    deliveries,
    outbox,
    partitions,
    queues,
    signals,
    tasks,
    webhooks,
)

if TYPE_CHECKING:
    from composer_ops.engine.engine import Engine

log = logging.getLogger(__name__)

#: How long a ready dispatch waits behind higher priorities of its queue before the timer
#: loop raises it to its queue's highest priority (see :meth:`Coordinator._age_priorities`).
PRIORITY_AGING_S = 60.0

#: The longest ``floor_every_s``: how late, at most, a run below the active floor that
#: gets an active task again is seen by the timers and the lease sweeper.
MAX_FLOOR_EVERY_S = 3600.0

#: After a failed read of the active floor or of the newest active run (on Citus, a
#: worker node down fails these reads over every shard), the next read is tried this
#: much later, not at every pass.
FAILED_READ_RETRY_S = 5.0


@dataclass
class PassStats:
    """What one pass of the loops did."""

    timers_fired: int = 0
    leases_expired: int = 0
    stale: int = 0
    partitions_created: int = 0
    webhooks_delivered: int = 0
    webhooks_failed: int = 0
    webhooks_pruned: int = 0
    months_dropped: list[str] = field(default_factory=list)
    months_blocked: list[str] = field(default_factory=list)   # past the cut-off, kept for active runs
    schedule_runs_started: int = 0
    schedule_slots_missed: int = 0
    schedule_slots_skipped: int = 0
    busy: int = 0                  # timers and leases whose run's lock was held elsewhere: backed off
    start_timeouts: int = 0        # tasks failed unclaimed past their schedule_to_start deadline
    priorities_raised: int = 0     # dispatches raised to their queue's top priority (the aging rule)
    slots_freed: int = 0           # flow_slots of attempts no longer RUNNING (sql/V003), healed
    waiters_forgotten: int = 0     # task_waiters rows of workers gone (killed), deleted
    children_delivered: int = 0    # child starts, cancels and finishes applied from their rows (Citus)
    node_scans: int = 0            # Citus: calls of composer_scan_node, one per worker node a pass
    node_scans_failed: int = 0     # Citus: node scans or prunes that failed (a node down): backed off
    node_errors: int = 0           # Citus: node scans failed otherwise (a bug, not delegated): through the coordinator
    scans_through_coordinator: bool = False   # Citus: the nodes did not cover every shard, or a node_error
    errors: list[str] = field(default_factory=list)


class Coordinator:
    """The loops of one coordinator process (``engine.coordinator()``), driven by one
    thread: :meth:`run` or :meth:`run_once`, not both at once (any number of coordinators,
    each its own object, may run side by side)."""

    def __init__(self, engine: Engine, *, interval: float = 0.5, batch: int = 100, months_ahead: int = 3,
                 upkeep_every_s: float = 3600.0, webhook_secret: str | None = None,
                 relay: RelayPolicy | None = None, upkeep_lock_timeout_s: float = 0.5,
                 retention: str | Cutoff | None = None, retention_every_s: float = 3600.0,
                 webhook_keep_days: float | None = 7.0, floor_every_s: float = 30.0,
                 event_lock_wait_s: float = 1.0, schedule_grace_s: float = 60.0,
                 priority_aging_s: float = PRIORITY_AGING_S) -> None:
        self.engine = engine
        self.interval = interval
        self.batch = batch
        self.months_ahead = months_ahead
        self.upkeep_every_s = upkeep_every_s
        self.webhook_secret = webhook_secret if webhook_secret is not None else os.environ.get(
            "COMPOSER_WEBHOOK_SECRET") or None
        self.relay = relay or RelayPolicy.from_env()
        self._stop = threading.Event()
        self.upkeep_lock_timeout_s = upkeep_lock_timeout_s
        self._timer_backoff = _Backoff()
        self.retention = parse_cutoff(retention) if isinstance(retention, str) else retention
        self.retention_every_s = retention_every_s
        if self.retention is not None:
            # Refused now, in one line, rather than a warning each retention pass for ever.
            roles.check_first(engine.pool, roles.require_owner, "coordinator --retention",
                              "its retention drops partitions")
        if webhook_keep_days is not None and not webhook_keep_days >= 0:
            raise Invalid(f"webhook_keep_days must be 0 or more days (or None: keep for ever), got {webhook_keep_days}")
        self.webhook_keep_days = webhook_keep_days
        if not 0 <= floor_every_s <= MAX_FLOOR_EVERY_S:
            raise Invalid(f"floor_every_s must be 0 to {MAX_FLOOR_EVERY_S:g} seconds, got {floor_every_s}")
        self.floor_every_s = floor_every_s
        if not event_lock_wait_s > 0:
            raise Invalid(f"event_lock_wait_s must be more than 0 seconds, got {event_lock_wait_s}")
        self.event_lock_wait_s = event_lock_wait_s
        if not schedule_grace_s >= 0:
            raise Invalid(f"schedule_grace_s must be 0 or more seconds, got {schedule_grace_s}")
        self.schedule_grace_s = schedule_grace_s
        if not priority_aging_s > 0:
            raise Invalid(f"priority_aging_s must be more than 0 seconds, got {priority_aging_s}")
        self.priority_aging_s = priority_aging_s
        self._next_aging = float("-inf")
        self._start_backoff = _Backoff()
        self._floor = ""
        self._next_floor = float("-inf")
        self._next_prune = float("-inf")
        self._next_retention = float("-inf")
        self._retention_failures = 0
        self._lease_backoff = _Backoff()
        self._child_backoff = _Backoff()
        self._next_upkeep = float("-inf")
        self._upkeep_failures = 0
        self._node_backoff = _Backoff(cap_s=30.0)
        self._prune_backoff = _Backoff(cap_s=300.0)
        self._ceiling: str | None = None
        self._next_ceiling = float("-inf")
        self._uncovered: str | None = None        # why the last pass scanned through the coordinator
        self._node_erred: tuple[str, str, str] | None = None   # the node error logged last (_node_error)
        # The pass's node scan, shared by its loops (_node_scan), is not locked, nor is any
        # state here (backoffs, floor, ceiling): one thread drives a Coordinator. run()
        # calls run_once(), which runs the loops one after another; the CLI starts run()
        # on one thread (cli/run_cmds.py); the webhook relay's POST threads
        # (engine/webhooks.py) get the pool, not the coordinator.
        self._pass_scan: citus_scan.NodeScan | None = None
        self._pass_scanned = False
        self._in_pass = False
        self._pass_kinds: tuple[str, ...] = citus_scan.ALL_KINDS

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Loop until ``stop()``; the pass in progress finishes first. Installs no signal
        handlers (the CLI entry point does). A ``stop()`` is final, whenever it is made: one
        made before ``run()`` makes it return without a pass, as does any ``run()`` after it
        (``run_once()`` still runs a pass)."""
        log.info("coordinator running (interval %.2fs)", self.interval)
        while not self._stop.is_set():
            stats = self.run_once()
            full = (stats.timers_fired + stats.leases_expired >= self.batch or stats.schedule_runs_started >= self.batch
                    or stats.children_delivered >= self.batch)
            if not full:
                self._stop.wait(self.interval)

    def run_once(self, loops: Collection[str] | None = None) -> PassStats:
        """One pass of every loop (or of the named ones: ``partitions``, ``schedules``,
        ``children``, ``timers``, ``leases``, ``webhooks``, ``retention``); a failing loop is
        logged and the others still run. Retention runs only when the coordinator was given
        a cut-off."""
        stats = PassStats()
        every = (("partitions", self._upkeep), ("schedules", self._schedules), ("children", self._children),
                 ("timers", self._timers), ("leases", self._leases), ("webhooks", self._webhooks),
                 ("retention", self._retention))
        if loops is not None and not set(loops) <= {name for name, _ in every}:
            raise Invalid(f"unknown coordinator loops {sorted(set(loops) - {name for name, _ in every})}")
        # On Citus the children loop, timers, start timeouts, lease sweeper and webhook
        # relay share one scan per worker node, made when the first of them needs it (see
        # _node_scan).
        self._pass_scan, self._pass_scanned, self._in_pass = None, False, True
        self._pass_kinds = tuple(kind for kind, loop in (("timer", "timers"), ("lease", "leases"),
                                                         ("start", "timers"), ("child", "children"),
                                                         ("webhook", "webhooks"))
                                 if loops is None or loop in loops)
        try:
            for name, loop in every:
                if loops is not None and name not in loops:
                    continue
                try:
                    loop(stats)
                except Exception as exc:  # one loop's failure (e.g. a lost connection) must not stop the others
                    log.warning("coordinator %s loop failed: %s", name, exc)
                    stats.errors.append(f"{name}: {exc}")
        finally:
            self._pass_scan, self._pass_scanned, self._in_pass = None, False, False
            self._pass_kinds = citus_scan.ALL_KINDS
        return stats

    def active_floor(self, conn: Any) -> str:
        """The run ID below which the timers and the lease sweeper do not look
        (:func:`~composer_ops.core.runids.active_floor` of the database clock and the
        oldest run with an active task), read again every ``floor_every_s``: the read
        itself plans every month, the scans it bounds only the months from the floor on.
        Any run that had an active task at the last read, or whose start began less than
        ``RUN_START_SLACK`` before it, is above the floor; a run below it that gets an
        active task again (an operator's retry of an old run, a start held open longer)
        is seen from the next read, at most ``floor_every_s`` later."""
        if time.monotonic() >= self._next_floor:
            try:
                oldest = tasks.active_floor(conn)
            except Exception as exc:
                # The floor read last is kept (the start's: none).
                self._next_floor = self._failed_read(conn, exc, "the active floor", self._floor)
                return self._floor
            floor = runids.active_floor(clock.now(conn), oldest)
            if floor != self._floor:
                log.info("the timers and the lease sweeper now read run IDs from %s on (the active floor)", floor)
            self._floor = floor
            self._next_floor = time.monotonic() + self.floor_every_s
        return self._floor

    def active_ceiling(self, conn: Any, now: datetime) -> str | None:
        """The run ID above which the node scans do not look on Citus
        (:func:`~composer_ops.core.runids.active_ceiling` of the database clock and the
        newest run with an active task, allowing for the starts of the next
        ``floor_every_s``), the newest run read again every ``floor_every_s`` as the
        floor is: with it a node scan plans only the months between floor and ceiling
        on each shard, not the empty months ahead. The clock's part is taken at ``now``
        (this pass's clock) on every call: a read that fails (a worker node down fails
        this read over every shard) keeps the newest run read last, but never a ceiling
        below the runs a start may make now, so the nodes still up handle the runs of a
        month begun during the outage. None (no ceiling) until a read succeeds."""
        if time.monotonic() >= self._next_ceiling:
            try:
                newest = tasks.active_ceiling(conn)
            except Exception as exc:
                self._next_ceiling = self._failed_read(conn, exc, "the newest active run", self._ceiling)
            else:
                self._ceiling = runids.active_ceiling(now, newest, self._ceiling_within)
                self._next_ceiling = time.monotonic() + self.floor_every_s
        if self._ceiling is None:
            return None
        return max(self._ceiling, runids.active_ceiling(now, None, self._ceiling_within))

    def _failed_read(self, conn: Any, exc: Exception, what: str, kept: str | None) -> float:
        """A read over every shard that failed: on Citus a worker node down fails it, and the
        value read last is kept so the other nodes' timers and leases are still handled.
        Re-raises when the coordinator's own connection is lost; returns when to read again
        (after ``FAILED_READ_RETRY_S``, not at every pass)."""
        if conn.broken or conn.closed:
            raise exc
        log.warning("coordinator: %s could not be read, keeping %r: %s", what, kept, exc)
        return time.monotonic() + min(self.floor_every_s, FAILED_READ_RETRY_S)

    @property
    def _ceiling_within(self) -> timedelta:
        return timedelta(seconds=self.floor_every_s)

    def _schedules(self, stats: PassStats) -> None:
        """Start the due slots of at most ``batch`` schedules (:meth:`Schedules.fire_due`):
        a slot due more than ``schedule_grace_s`` ago is late, which a schedule whose
        catch-up is ``none`` does not start."""
        done = self.engine.schedules.fire_due(limit=self.batch, grace_s=self.schedule_grace_s,
                                              max_starts=self.batch)
        stats.schedule_runs_started += done.started
        stats.schedule_slots_missed += done.missed
        stats.schedule_slots_skipped += done.skipped
        stats.errors.extend(done.errors)

    def _children(self, stats: PassStats) -> None:
        """Deliver up to ``batch`` child rows (Citus: a SUB_WORKFLOW child's start, cancel
        or finish, engine/childrows.py), the oldest first: the ones this thread's own
        events wrote, then those the engine that wrote them did not deliver (it died, or
        the delivery failed). Each is applied idempotently, so a row another coordinator
        or engine is applying meanwhile is skipped (its lock) or applied as a no-op; a
        row whose delivery fails is backed off. On Citus the rows are read by the pass's
        node scans (:meth:`_node_scan`). A single server writes no rows."""
        stats.children_delivered += childrows.drain(self.engine.shell)
        with self.engine.pool.connection() as conn, autocommit(conn):
            scan = self._node_scan(conn, stats)
            keys = [c.key for c in scan.children] if scan is not None else deliveries.pending(
                conn, self.batch, skip=self._child_backoff.skipped())
        for key in keys:
            try:
                stats.children_delivered += childrows.deliver(self.engine.shell, key)
            except Exception as exc:
                if isinstance(exc, Transient):
                    raise
                self._child_backoff.failed(deliveries.key_text(key))
                stats.errors.append(f"child delivery {key[0]} -> {key[1]}: {exc}")
                log.warning("coordinator: child delivery %s -> %s failed, backing off: %s", *key, exc,
                            exc_info=not isinstance(exc, ComposerError))
                continue
            self._child_backoff.succeeded(deliveries.key_text(key))
            stats.children_delivered += childrows.drain(self.engine.shell)

    def _timers(self, stats: PassStats) -> None:
        # The scans are plain reads, each its own statement: in autocommit, a scan over
        # every shard of a Citus cluster opens no distributed transaction on each worker
        # connection (a BEGIN and a transaction ID per connection, per pass).
        with self.engine.pool.connection() as conn, autocommit(conn):
            scan = self._node_scan(conn, stats)
            due = scan.timers if scan is not None else signals.due_waits(
                conn, self.batch, now=clock.now(conn), skip=self._timer_backoff.skipped(),
                floor=self.active_floor(conn))
        locked: set[str] = set()
        for wait in due:
            outcome = self._handle("timer", wait.task_id, wait.task_id, wait.run_id,
                                   partial(_timer_due, wait.task_id, wait.node_id), self._timer_backoff, stats, locked)
            if outcome is not None and not outcome.stale:
                stats.timers_fired += 1
        self._start_timeouts(stats)
        self._age_priorities(stats)

    def _start_timeouts(self, stats: PassStats) -> None:
        """Fail the tasks whose dispatch no worker claimed by its schedule_to_start
        deadline (judged in SQL by the database clock, through the outbox's partial index);
        under the run lock the dispatch is deleted first, so a claim that took it in time wins."""
        with self.engine.pool.connection() as conn, autocommit(conn):
            scan = self._node_scan(conn, stats)
            late = scan.starts if scan is not None else outbox.unstarted(
                conn, self.batch, now=clock.now(conn), skip=self._start_backoff.skipped())
        locked: set[str] = set()
        for row in late:
            outcome = self._handle("start timeout", row.task_id, f"{row.task_id}:{row.attempt}", row.run_id,
                                   partial(_start_timed_out, row.task_id, row.attempt), self._start_backoff, stats,
                                   locked)
            if outcome is not None and not outcome.stale:
                stats.start_timeouts += 1

    def _age_priorities(self, stats: PassStats) -> None:
        """The no-starvation rule of priorities: a dispatch ready for ``priority_aging_s``
        is raised to the highest priority of its queue's dispatches, where the oldest is
        claimed first; so while higher priorities keep a queue's workers busy, a lower
        one waits about ``priority_aging_s`` plus the older top-priority backlog, never
        for ever. Every quarter of ``priority_aging_s`` at most: the statement reads the
        whole outbox (a queue: small), and changes nothing when no priority is set."""
        if time.monotonic() < self._next_aging:
            return
        self._next_aging = time.monotonic() + self.priority_aging_s / 4
        with self.engine.pool.connection() as conn, autocommit(conn):
            stats.priorities_raised += outbox.raise_waiting(conn, self.priority_aging_s)

    def _leases(self, stats: PassStats) -> None:
        with self.engine.pool.connection() as conn, autocommit(conn):
            scan = self._node_scan(conn, stats)
            expired = scan.leases if scan is not None else tasks.expired_leases(
                conn, self.batch, now=clock.now(conn), skip=self._lease_backoff.skipped(),
                floor=self.active_floor(conn))
        locked: set[str] = set()
        for lease in expired:
            ref = TaskRef(task_id=lease.task_id, run_id=lease.run_id, node_id=lease.node_id,
                          attempt=lease.attempt, lease_owner=lease.lease_owner)
            outcome = self._handle("lease", lease.task_id, f"{lease.task_id}:{lease.attempt}", lease.run_id,
                                   partial(_lease_expired, ref, lease.timed_out), self._lease_backoff, stats,
                                   locked)
            if outcome is not None and not outcome.stale:
                stats.leases_expired += 1
                log.info("lease of task %s (run %s, owner %s) expired", lease.task_id, lease.run_id,
                         lease.lease_owner, extra={"action": "lease_expired", "run_id": lease.run_id})
        self._heal_slots(stats)

    def _covering_keys(self, conn: Any, stats: PassStats) -> list[str] | None:
        """On Citus, the stream keys, one per worker node (two keys on one node, after a
        shard move, keep the first), when their nodes hold every shard
        (:func:`citus_scan.covered`; the keys are found afresh once when they do not);
        None on a single server, or when they still do not (a shard move in
        progress, a node added): then this pass runs the statements over every shard
        through the coordinator, and says so."""
        if not self.engine.shell.on_citus(conn):
            return None
        coverage = citus_scan.covered(conn, self.engine.stream_keys(conn))
        if coverage.why is not None:
            coverage = citus_scan.covered(conn, self.engine.stream_keys(conn, fresh=True))
        why = coverage.why
        if why is not None:
            stats.scans_through_coordinator = True
            if why != self._uncovered:
                log.warning("coordinator: the worker nodes' scans do not cover every shard (%s): the pass scans "
                            "every shard through the coordinator until they do", why)
            self._uncovered = why
            return None
        if self._uncovered is not None:
            log.info("coordinator: the worker nodes cover every shard again: one scan per node")
            self._uncovered = None
        return coverage.keys

    def _node_scan(self, conn: Any, stats: PassStats) -> citus_scan.NodeScan | None:
        """On Citus, this pass's candidates of the timers, the start timeouts, the lease
        sweeper, the children loop and the webhook relay: one ``composer_scan_node`` call
        per worker node (:func:`citus_scan.scan_node`), made once a pass, for the loops
        the pass runs.
        A node whose call fails to reach it (:class:`Unavailable`: down, unreachable,
        overloaded) is logged and backed off (1 s, 2 s, ... up to 30 s) and the other
        nodes' candidates are used: its rows stay where they are, and a pass after it is
        back finds them. Any other error (a bug, an error of the SQL function, a call
        Citus did not delegate) says nothing about the node: no node is backed off, it
        is counted and logged with its traceback (:meth:`_node_error`), and the pass
        scans through the coordinator instead. None: the statements over every shard
        are to be used (a single server, keys not covering every shard, such an
        error)."""
        if self._in_pass and self._pass_scanned:
            return self._pass_scan
        self._pass_scanned = self._in_pass      # a loop called on its own scans for itself
        keys = self._covering_keys(conn, stats)
        if keys is None:
            return None
        now = clock.now(conn)
        floor, ceiling = self.active_floor(conn), self.active_ceiling(conn, now)
        skipped = set(self._node_backoff.skipped())
        # The relay takes up to its own batch of deliveries a pass, the other loops up to ``batch``.
        limit = max(self.batch, self.relay.batch) if "webhook" in self._pass_kinds else self.batch
        found: list[Any] = []
        for key in keys:
            if key in skipped:
                continue
            try:
                found += citus_scan.scan_node(conn, key, now=now, floor=floor, ceiling=ceiling, limit=limit,
                                              kinds=self._pass_kinds, skip_timers=self._timer_backoff.skipped(),
                                              skip_leases=self._lease_backoff.skipped(),
                                              skip_starts=self._start_backoff.skipped(),
                                              skip_children=self._child_backoff.skipped())
            except Exception as exc:
                if conn.broken or conn.closed:
                    raise           # the coordinator itself is lost: the loop fails, as without nodes
                if isinstance(exc, Unavailable):
                    self._node_failed(stats, "scan", key, exc)
                    continue
                self._node_error(stats, "scan", key, exc)
                stats.scans_through_coordinator = True
                self._pass_scan = None
                return None
            stats.node_scans += 1
            self._node_backoff.succeeded(key)
        if self._node_erred is not None:
            log.info("coordinator: the worker nodes' scans succeed again")
            self._node_erred = None
        self._pass_scan = citus_scan.merge(found, self.batch, webhook_limit=self.relay.batch)
        return self._pass_scan

    def _node_failed(self, stats: PassStats, what: str, key: str, exc: Exception,
                     backoff: _Backoff | None = None) -> None:
        (backoff or self._node_backoff).failed(key)
        stats.node_scans_failed += 1
        stats.errors.append(f"{what} of the node of stream key {key}: {exc}")
        log.warning("coordinator: the %s of the worker node of stream key %s failed, backing it off; the other "
                    "nodes go on: %s", what, key, exc, exc_info=None if isinstance(exc, Unavailable) else exc)

    def _node_error(self, stats: PassStats, what: str, key: str, exc: Exception) -> None:
        """A node call's error that is not about reaching the node: counted in
        ``node_errors`` and ``errors`` on every pass, logged with its traceback once
        until another error comes or the node scans succeed again (each pass meets it
        again: a log line per pass would bury the first)."""
        stats.node_errors += 1
        stats.errors.append(f"{what} of the node of stream key {key}: {exc}")
        seen = (what, type(exc).__name__, str(exc))
        if seen == self._node_erred:
            log.debug("coordinator: the %s of the worker node of stream key %s failed again: %s", what, key, exc)
            return
        self._node_erred = seen
        log.error("coordinator: the %s of the worker node of stream key %s failed with an error that is not about "
                  "reaching the node; no node is backed off, the pass scans every shard through the coordinator "
                  "(logged once while it repeats): %s", what, key, exc, exc_info=exc)

    def _heal_slots(self, stats: PassStats) -> None:
        """Delete the registrations of workers gone (:func:`outbox.forget_dead`), and free
        the places under a queue's limit that an attempt no longer RUNNING still
        holds: the trigger of sql/R__claim.sql frees them as attempts end, this catches
        what bypassed it. On Citus, where no trigger frees them and claims free the places
        of a key only when it is at its limit, this frees the rest, so the reports' counts
        of places and keys at their limit stay true (:func:`citus_flow.free_stale`)."""
        with self.engine.pool.connection() as conn:
            on_citus = self.engine.shell.on_citus(conn)
            with conn.transaction():
                stats.slots_freed += citus_flow.free_stale(conn) if on_citus else queues.free_stale_slots(conn)
            if not on_citus:            # no claim registers on Citus
                with conn.transaction():
                    stats.waiters_forgotten += outbox.forget_dead(conn)

    def _handle(self, kind: str, task_id: str, key: str, run_id: str, make_event: Callable[[datetime], Event],
                backoff: _Backoff, stats: PassStats, locked: set[str]) -> Outcome | None:
        """One candidate of a loop, under the run lock. A candidate the event did not
        change (stale: another coordinator got there first, or it can never apply) or
        that failed is backed off under ``key`` (a timer's task; a lease's task and
        attempt, so a later attempt starts afresh), so the next pass reaches the rows
        behind it; a database that stays unreachable after the shell's retries ends the
        pass. So is one whose event waited more than ``event_lock_wait_s`` for a lock
        (its run's, or a row of the run; an operator's transaction left open; on Citus,
        a transaction left prepared on a worker node that crashed, until Citus's
        recovery resolves it): waiting for it held up every candidate behind it. Its run
        joins ``locked``, the loop's runs found locked in this pass, whose other
        candidates are backed off without waiting again."""
        if run_id in locked:
            backoff.failed(key)
            stats.busy += 1
            return None
        try:
            outcome = self.engine.shell.handle(run_id, make_event, lock_wait_s=self.event_lock_wait_s)
        except LockTimeout:
            backoff.failed(key)
            locked.add(run_id)
            stats.busy += 1
            log.info("coordinator: %s of task %s (run %s) waited %.1fs for a lock of its run; backing off",
                     kind, task_id, run_id, self.event_lock_wait_s)
            return None
        except Exception as exc:
            if isinstance(exc, Transient):
                raise
            backoff.failed(key)
            stats.errors.append(f"{kind} {task_id} of run {run_id}: {exc}")
            log.warning("coordinator: %s of task %s (run %s) failed, backing off: %s", kind, task_id, run_id, exc,
                        exc_info=not isinstance(exc, ComposerError))
            return None
        if outcome.stale:
            stats.stale += 1
            backoff.failed(key)
        else:
            backoff.succeeded(key)
        return outcome

    def _upkeep(self, stats: PassStats) -> None:
        """Ensure months ahead, at most every ``upkeep_every_s``. Attaching a partition
        waits for writers of workflow_runs and starts would queue behind that wait, so
        it gives up after ``upkeep_lock_timeout_s`` and is tried again after a backoff
        (1 s, 2 s, ... up to a minute): months are created well ahead, so a late
        attempt costs nothing."""
        if time.monotonic() < self._next_upkeep:
            return
        try:
            with self.engine.pool.connection() as conn, conn.transaction():
                stats.partitions_created += partitions.ensure(conn, self.months_ahead,
                                                              lock_timeout_s=self.upkeep_lock_timeout_s)
        except Exception:
            self._upkeep_failures += 1
            self._next_upkeep = time.monotonic() + min(60.0, 2.0 ** (self._upkeep_failures - 1))
            raise
        self._upkeep_failures = 0
        self._next_upkeep = time.monotonic() + self.upkeep_every_s

    def _retention(self, stats: PassStats) -> None:
        """The optional retention: drop the months past ``retention`` (the same function
        as ``composer-ops partitions drop --yes``), at most every ``retention_every_s``,
        backing off like upkeep when it fails. Needs the owner role (the engine role
        may not drop partitions): a coordinator of another role is refused when made."""
        if self.retention is None or time.monotonic() < self._next_retention:
            return
        try:
            done = drop_due_months(self.engine.pool, self.retention, lock_timeout_s=self.upkeep_lock_timeout_s,
                                   max_attempts=3, actor=Actor(command=f"coordinator retention {self.retention.text}",
                                                               host=socket.gethostname()))
        except Exception:
            self._retention_failures += 1
            self._next_retention = time.monotonic() + min(self.retention_every_s,
                                                          2.0 ** min(self._retention_failures + 3, 16))
            raise
        self._retention_failures = 0
        self._next_retention = time.monotonic() + self.retention_every_s
        stats.months_dropped += done.dropped
        if done.dropped:
            log.info("retention dropped %s (cut-off %s)", ", ".join(done.dropped), done.cutoff.isoformat())
        for month in done.blocked:
            stats.months_blocked.append(month.month)
            log.warning("retention kept %s: %d active run(s), e.g. %s", month.month, month.active_runs,
                        ", ".join(month.active_run_ids[:5]))

    def _webhooks(self, stats: PassStats) -> None:
        """POST the due deliveries (:func:`relay_once`; on Citus, the candidates of this
        pass's node scans, read when the pass's first loop needed them: the relay takes
        those still due, and one that fell due since waits for the next pass), then prune."""
        with self.engine.pool.connection() as conn, autocommit(conn):
            scan = self._node_scan(conn, stats)
        delivered, failed = relay_once(self.engine.pool, secret=self.webhook_secret, policy=self.relay,
                                       due=None if scan is None else scan.webhooks)
        stats.webhooks_delivered += delivered
        stats.webhooks_failed += failed
        self._prune_webhooks(stats)

    def _prune_webhooks(self, stats: PassStats, batch: int = 1000, max_batches: int = 10) -> None:
        """Delete deliveries finished more than ``webhook_keep_days`` ago, at most every
        ``upkeep_every_s``: batches of ``batch`` rows, each its own short transaction,
        at most ``max_batches`` a pass (the rest waits for the next). A batch is retried
        on a lost connection (deleting again deletes what is left); a pass that still
        fails leaves the prune due on the next pass."""
        if self.webhook_keep_days is None or time.monotonic() < self._next_prune:
            return
        with self.engine.pool.connection() as conn, autocommit(conn):
            keys = self._covering_keys(conn, stats)
        if keys is not None:
            self._prune_nodes(stats, keys, batch, max_batches)
            return
        for _ in range(max_batches):
            gone = _prune_batch(self.engine.pool, self.webhook_keep_days * 86400.0, batch)
            stats.webhooks_pruned += gone
            if gone < batch:
                self._next_prune = time.monotonic() + self.upkeep_every_s
                return
        self._next_prune = time.monotonic()     # more left: continue on the next pass

    def _prune_nodes(self, stats: PassStats, keys: Sequence[str], batch: int, max_batches: int) -> None:
        """The prune on Citus: node by node, batches of one delegated call each
        (:func:`citus_scan.prune_webhooks_on_node`), a one-phase transaction of that
        node; up to ``max_batches`` per node a pass. A node whose call fails is logged
        and the prune stays due for the next pass; the other nodes go on."""
        assert self.webhook_keep_days is not None
        keep_s, more = self.webhook_keep_days * 86400.0, False
        # Its own backoff: a failing prune (a lock or statement timeout on a large
        # delete) must not hold up that node's scans, nor be retried at every pass.
        skipped = set(self._prune_backoff.skipped())
        for key in keys:
            if key in skipped:
                more = True
                continue
            for _ in range(max_batches):
                try:
                    with self.engine.pool.connection() as conn, autocommit(conn):
                        gone = citus_scan.prune_webhooks_on_node(conn, key, keep_s, batch)
                except Exception as exc:
                    self._node_failed(stats, "webhook prune", key, exc, self._prune_backoff)
                    more = True
                    break
                self._prune_backoff.succeeded(key)
                stats.webhooks_pruned += gone
                if gone < batch:
                    break
            else:
                more = True
        self._next_prune = time.monotonic() + (0.0 if more else self.upkeep_every_s)


class _Backoff:
    """Candidates a loop could not change, skipped for 1 s, 2 s, 4 s ... up to 5 min
    after each miss. Kept in memory: a restarted coordinator simply tries them again.
    At most ``limit`` are skipped at once (the oldest misses first), which bounds the
    list the loop's query excludes."""

    def __init__(self, cap_s: float = 300.0, limit: int = 500) -> None:
        self.cap_s, self.limit = cap_s, limit
        self._misses: dict[str, tuple[float, int]] = {}   # task id -> (skip until, misses)

    def failed(self, key: str) -> None:
        misses = self._misses.get(key, (0.0, 0))[1] + 1
        self._misses[key] = (time.monotonic() + min(self.cap_s, 2.0 ** (misses - 1)), misses)

    def succeeded(self, key: str) -> None:
        self._misses.pop(key, None)

    def skipped(self) -> list[str]:
        now = time.monotonic()
        # forget a row once its skip is long over (it succeeded elsewhere or went away)
        for key in [k for k, (until, _) in self._misses.items() if until + self.cap_s < now]:
            del self._misses[key]
        waiting = sorted((until, key) for key, (until, _) in self._misses.items() if until > now)
        return [key for _, key in waiting[:self.limit]]


@db_retry()
def _prune_batch(pool: TranslatingPool, keep_s: float, batch: int) -> int:
    with pool.connection() as conn, conn.transaction():
        return webhooks.prune(conn, keep_s, batch)


def _timer_due(task_id: str, node_id: str, now: datetime) -> TimerDue:
    return TimerDue(task_id=task_id, node_id=node_id, now=now)


def _start_timed_out(task_id: str, attempt: int, now: datetime) -> StartTimedOut:
    return StartTimedOut(task_id=task_id, attempt=attempt, now=now)


def _lease_expired(ref: TaskRef, timed_out: bool, now: datetime) -> LeaseExpired:
    return LeaseExpired(ref=ref, now=now, timed_out=timed_out)
