"""Schedules through the engine (``engine.schedules``): create, list, pause, resume,
delete, trigger and backfill, each an operator action with its audit row in the same
transaction; and the coordinator's pass that starts due slots.

A slot's run ID is derived from the schedule and the slot
(:func:`composer_ops.core.schedules.slot_run_id`), and its run starts through the
engine's one start (:func:`composer_ops.engine.starts.start_in`), in the transaction
that holds the schedule's row lock and moves its slot cursor. Two coordinators never decide one
schedule at once (``FOR UPDATE SKIP LOCKED``), a pass retried after a lost COMMIT
acknowledgement finds the cursor moved, and, whatever else happens, a second start of
a slot names a run ID that exists and starts nothing.
"""

from __future__ import annotations

import builtins
import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from composer_ops.core import schedules as rules
from composer_ops.core.actor import Actor
from composer_ops.core.cutoff import Cutoff
from composer_ops.core.runids import month_of
from composer_ops.core.selection import parse_when
from composer_ops.db.retry import db_retry
from composer_ops.engine.jsonvalues import check_json
from composer_ops.engine.requests import Request
from composer_ops.engine.starts import start_in
from composer_ops.errors import ComposerError, Conflict, Invalid, NotFound, Transient
from composer_ops.repo import audit, clock, definitions, partitions, retention
from composer_ops.repo import schedules as repo
from composer_ops.repo.schedules import ScheduleEvent, ScheduleRow, ScheduleSummary

if TYPE_CHECKING:
    from composer_ops.engine.engine import Engine

log = logging.getLogger(__name__)

__all__ = ["MAX_BACKFILL", "Backfill", "PassResult", "Schedules", "slot_input"]

#: The most slots one backfill starts (a wider window is refused: split it).
MAX_BACKFILL = 1000
#: The most slots one pass looks at per schedule; the rest wait for the next pass.
SLOTS_PER_PASS = 1000
#: How long a pass retried after a lost connection waits for the schedule's row lock,
#: which the lost attempt's session holds until the server has noticed the cut.
RETRY_LOCK_WAIT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class BackfillSlot:
    slot: datetime
    run_id: str
    action: str                       # "start", or "exists" (the slot has its run)


@dataclass(frozen=True, kw_only=True)
class Backfill:
    """A backfill's plan, and with ``applied`` what it did."""

    schedule: str
    slots: list[BackfillSlot]
    applied: bool
    started: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "applied": self.applied, "started": self.started,
                "slots": [{"slot": s.slot, "run_id": s.run_id, "action": s.action} for s in self.slots]}


@dataclass
class PassResult:
    """What one coordinator pass over the due schedules did."""

    started: int = 0
    missed: int = 0
    skipped: int = 0
    buffered: int = 0
    contended: int = 0               # due schedules another coordinator held
    errors: list[str] = field(default_factory=list)


def slot_input(base: Any, name: str, slot: datetime, source: str) -> dict[str, Any]:
    """A scheduled run's input: the schedule's input object with ``_schedule`` (its
    name, the slot instant in UTC and what started it) added."""
    doc = dict(base) if isinstance(base, dict) else {}
    doc["_schedule"] = {"name": name, "slot": _iso(slot), "source": source}
    return doc


def _iso(ts: datetime) -> str:
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Schedules:
    """``engine.schedules``. Every action takes the schedule's name; every change is
    recorded in ``operator_audit`` with the call's request, in its transaction, so a
    retry whose lost attempt committed finds that row and returns what it did."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # -- operator actions -------------------------------------------------------

    def create(self, name: str, *, workflow: str, cron: str, timezone: str, input: Any = None,
               overlap: str = "skip", catchup: str = "latest", actor: Actor | None = None,
               yes: bool = True) -> ScheduleRow:
        """A schedule starting runs of ``workflow`` at each slot of ``cron`` in ``timezone``.
        Everything is checked before anything is written: the name, the workflow (deployed),
        the cron fields, the zone, the input (a JSON object or None), the policies. Not
        ``yes``: a dry run, made and rolled back (the row it returns is what would be)."""
        from composer_ops.engine.engine import _check_workflow_id

        rules.check_name(name)
        _check_workflow_id(workflow)
        expr = rules.check_cron(cron)
        rules.check_zone(timezone)
        if input is not None and not isinstance(input, dict):
            raise Invalid(f"schedule input must be a JSON object (its runs' input gets a _schedule key), "
                          f"got {type(input).__name__}")
        check_json(input, "input")
        rules.check_policy("overlap", overlap)
        rules.check_policy("catchup", catchup)
        return self._create(name, workflow, expr, timezone, input, overlap, catchup, actor, Request(), yes)

    @db_retry()
    def _create(self, name: str, workflow: str, cron: str, timezone: str, input: Any, overlap: str, catchup: str,
                actor: Actor | None, request: Request, yes: bool = True) -> ScheduleRow:
        look = request.attempt()
        with self.engine.pool.connection() as conn, conn.transaction(force_rollback=not yes):
            audit.require_record(conn, "schedules create")
            now, target = definitions.clock_and_start_target(conn, workflow, None)
            if target is None:
                definitions.refuse_missing(conn, workflow, None)
            try:
                row = repo.insert(conn, schedule_id=str(uuid.uuid4()), name=name, workflow_id=workflow, cron=cron,
                                  timezone=timezone, input=input, overlap=overlap, catchup=catchup,
                                  next_slot_at=rules.next_slot(cron, rules.check_zone(timezone), now), now=now)
            except Conflict:
                # The insert waited for an earlier attempt of this call still committing.
                if look and audit.of_request(conn, request.id):
                    found = repo.by_name(conn, name)
                    if found is not None:
                        return found
                raise
            audit.record(conn, "schedules create", actor=actor, target=name, request=request.id,
                         counts={"schedules": 1},
                         detail={"workflow": workflow, "cron": cron, "timezone": timezone, "overlap": overlap,
                                 "catchup": catchup, "next_slot_at": _iso(row.next_slot_at)
                                 if row.next_slot_at else None})
        if yes:
            log.info("created schedule %s (%s, %s) of %s", name, cron, timezone, workflow,
                     extra={"action": "schedule_create"})
        return row

    def get(self, name: str) -> ScheduleRow:
        rules.check_name(name)
        with self.engine.pool.connection() as conn:
            row = repo.by_name(conn, name)
        if row is None:
            raise NotFound(f"schedule {name!r} does not exist")
        return row

    def list(self) -> list[ScheduleSummary]:
        """Every schedule by name, with its last run's status and the slots it missed or skipped."""
        with self.engine.pool.connection() as conn:
            return repo.summaries(conn)

    def pause(self, name: str, *, actor: Actor | None = None, yes: bool = True) -> bool:
        """Stop starting slots; True if it was running. Slots while paused are not run.
        Not ``yes``: a dry run (made and rolled back)."""
        return self._set_paused(name, True, actor, Request(), yes)

    def resume(self, name: str, *, actor: Actor | None = None, yes: bool = True) -> bool:
        """Start slots again from the first slot after now; True if it was paused. Not
        ``yes``: a dry run (made and rolled back)."""
        return self._set_paused(name, False, actor, Request(), yes)

    @db_retry()
    def _set_paused(self, name: str, paused: bool, actor: Actor | None, request: Request, yes: bool = True) -> bool:
        rules.check_name(name)
        action = "schedules pause" if paused else "schedules resume"
        look = request.attempt()
        with self.engine.pool.connection() as conn, conn.transaction(force_rollback=not yes):
            row = self._lock(conn, name, action)
            if look and (earlier := audit.of_request(conn, request.id)):
                return bool(earlier[0].counts.get("schedules"))
            changed = row.paused != paused
            now = clock.now(conn)
            if changed:
                following = None if paused else rules.next_slot(row.cron, rules.check_zone(row.timezone), now)
                repo.set_paused(conn, row.id, paused=paused, next_slot_at=following, now=now)
            audit.record(conn, action, actor=actor, target=name, request=request.id,
                         counts={"schedules": int(changed)}, detail={"already": not changed})
        return changed

    def delete(self, name: str, *, actor: Actor | None = None) -> str:
        """Delete the schedule: no slot starts any more; its runs go on. Returns its id."""
        rules.check_name(name)
        return self._delete(name, actor, Request())

    @db_retry()
    def _delete(self, name: str, actor: Actor | None, request: Request) -> str:
        look = request.attempt()
        with self.engine.pool.connection() as conn, conn.transaction():
            audit.require_record(conn, "schedules delete")
            # Lock, then look: an earlier attempt still committing holds the row, and once
            # it has committed the name is gone and its audit row says what it deleted.
            row = repo.by_name(conn, name, lock=True)
            if look and (earlier := audit.of_request(conn, request.id)):
                return str(earlier[0].detail["id"])
            if row is None:
                raise NotFound(f"schedule {name!r} does not exist")
            repo.soft_delete(conn, row.id, clock.now(conn))
            audit.record(conn, "schedules delete", actor=actor, target=name, request=request.id,
                         counts={"schedules": 1}, detail={"id": row.id})
        return row.id

    def trigger(self, name: str, *, actor: Actor | None = None, yes: bool = True) -> str:
        """Start one run now (a slot at the database clock, whatever the overlap
        policy); returns its run ID. Not ``yes``: a dry run, made and rolled back
        (the run ID it returns was not started)."""
        rules.check_name(name)
        return self._trigger(name, actor, Request(), yes)

    @db_retry()
    def _trigger(self, name: str, actor: Actor | None, request: Request, yes: bool = True) -> str:
        look = request.attempt()
        with self.engine.pool.connection() as conn, conn.transaction(force_rollback=not yes):
            row = self._lock(conn, name, "schedules trigger")
            if look and (earlier := audit.of_request(conn, request.id)):
                return str(earlier[0].detail["run_id"])
            now = clock.now(conn)
            run_id, refused = self._start_slot(conn, now, row, now, "trigger", "trigger", request)
            if refused is not None:
                raise Invalid(f"schedule {name!r}: {refused}")
            repo.set_last_run(conn, row.id, slot=now, run_id=run_id, now=now)
            repo.record(conn, row.id, [ScheduleEvent(kind="started", source="trigger", first_slot_at=now,
                                                     last_slot_at=now, run_id=run_id)], now)
            audit.record(conn, "schedules trigger", actor=actor, target=name, request=request.id,
                         counts={"runs": 1}, detail={"run_id": run_id, "slot": _iso(now)})
        if yes:
            log.info("schedule %s triggered run %s", name, run_id,
                     extra={"action": "schedule_trigger", "run_id": run_id})
        return run_id

    def backfill(self, name: str, *, start: datetime | str, end: datetime | str, yes: bool = False,
                 actor: Actor | None = None) -> Backfill:
        """The slots ``start <= slot < end`` (ISO dates or instants, or ages counted back
        from the database clock), each started as its slot's run (one run per slot:
        a slot that has its run already is left alone), whatever the overlap policy.
        Without ``yes`` nothing is written. Refused: an empty or future window, more
        than MAX_BACKFILL slots, a slot in a month without a partition."""
        rules.check_name(name)
        return self._backfill(name, parse_when(start, "--from"), parse_when(end, "--to"), yes, actor, Request())

    @db_retry()
    def _backfill(self, name: str, start: datetime | Cutoff, end: datetime | Cutoff, yes: bool, actor: Actor | None,
                  request: Request) -> Backfill:
        look = request.attempt()
        with self.engine.pool.connection() as conn, conn.transaction():
            row = self._lock(conn, name, "schedules backfill") if yes else self.get_in(conn, name)
            if look and yes and (earlier := audit.of_request(conn, request.id)):
                return Backfill(schedule=name, slots=[BackfillSlot(slot=datetime.fromisoformat(s["slot"]),
                                                                   run_id=s["run_id"], action=s["action"])
                                                      for s in earlier[0].detail["slots"]],
                                applied=True, started=int(earlier[0].counts["runs"]))
            now = clock.now(conn)
            first, last = retention.resolve(conn, start), retention.resolve(conn, end)
            if not first < last:
                raise Invalid(f"backfill window is empty: --from {_iso(first)} is not before --to {_iso(last)}")
            if last > now:
                raise Invalid(f"backfill --to {_iso(last)} is after the database clock {_iso(now)}: "
                              "slots to come start by themselves")
            zone = rules.check_zone(row.timezone)
            slots = [s for s in rules.slots_between(row.cron, zone, first - timedelta(seconds=1), last,
                                                    MAX_BACKFILL + 2) if first <= s < last]
            if len(slots) > MAX_BACKFILL:
                raise Invalid(f"backfill of {name!r} from {_iso(first)} to {_iso(last)} holds more than "
                              f"{MAX_BACKFILL} slots: split the window")
            ids = [rules.slot_run_id(row.id, "cron", s) for s in slots]
            for slot, run_id in zip(slots, ids, strict=True):
                try:
                    partitions.require_run_partition(conn, run_id)
                except Invalid:
                    raise Invalid(f"backfill slot {_iso(slot)} falls in month {month_of(run_id)}, which has no "
                                  "partition (composer-ops partitions list)") from None
            have = repo.existing_runs(conn, ids)
            plan = [BackfillSlot(slot=s, run_id=r, action="exists" if r in have else "start")
                    for s, r in zip(slots, ids, strict=True)]
            if not yes:
                return Backfill(schedule=name, slots=plan, applied=False)
            started = 0
            events: list[ScheduleEvent] = []
            for item in plan:
                if item.action != "start":
                    continue
                _, refused = self._start_slot(conn, now, row, item.slot, "cron", "backfill", request)
                if refused is not None:
                    raise Invalid(f"backfill of {name!r}: {refused}")
                started += 1
                events.append(ScheduleEvent(kind="started", source="backfill", first_slot_at=item.slot,
                                            last_slot_at=item.slot, run_id=item.run_id))
            repo.record(conn, row.id, events, now)
            audit.record(conn, "schedules backfill", actor=actor, target=name, request=request.id,
                         counts={"runs": started, "slots": len(plan)},
                         detail={"from": _iso(first), "to": _iso(last),
                                 "slots": [{"slot": _iso(s.slot), "run_id": s.run_id, "action": s.action}
                                           for s in plan]})
        return Backfill(schedule=name, slots=plan, applied=True, started=started)

    def get_in(self, conn: Any, name: str) -> ScheduleRow:
        row = repo.by_name(conn, name)
        if row is None:
            raise NotFound(f"schedule {name!r} does not exist")
        return row

    def _lock(self, conn: Any, name: str, action: str) -> ScheduleRow:
        audit.require_record(conn, action)
        row = repo.by_name(conn, name, lock=True)
        if row is None:
            raise NotFound(f"schedule {name!r} does not exist")
        return row

    # -- the coordinator's pass -----------------------------------------------------

    def fire_due(self, *, limit: int = 100, grace_s: float = 60.0, max_starts: int = 100,
                 buffer_poll_s: float = 5.0) -> PassResult:
        """Decide the slots of at most ``limit`` due schedules, each in its own
        transaction (:meth:`fire_one`)."""
        result = PassResult()
        for schedule_id in self._due(limit):
            try:
                self.fire_one(schedule_id, result, grace=timedelta(seconds=grace_s), max_starts=max_starts,
                              buffer_poll=timedelta(seconds=buffer_poll_s))
            except Transient:
                raise                   # the database is away: the pass ends, as the other loops' do
            except Exception as exc:    # one schedule's failure (a row edited by hand) must not stop the others
                result.errors.append(f"schedule {schedule_id}: {exc}")
                log.warning("coordinator: schedule %s failed: %s", schedule_id, exc,
                            exc_info=not isinstance(exc, ComposerError))
        return result

    @db_retry()
    def _due(self, limit: int) -> builtins.list[str]:
        with self.engine.pool.connection() as conn:
            return repo.due(conn, clock.now(conn), limit)

    def fire_one(self, schedule_id: str, result: PassResult, *, grace: timedelta, max_starts: int,
                 buffer_poll: timedelta) -> None:
        """Lock one due schedule (skipped if another coordinator holds it or decided it
        already), plan its due slots by its policies, start the runs, record the slots
        not started, and move its cursor: one transaction."""
        self._fire_one(schedule_id, result, Request(), grace=grace, max_starts=max_starts, buffer_poll=buffer_poll)

    @db_retry()
    def _fire_one(self, schedule_id: str, result: PassResult, request: Request, *, grace: timedelta,
                  max_starts: int, buffer_poll: timedelta) -> None:
        # A retry follows an attempt whose connection broke: its session may hold the
        # schedule's row lock until the server notices, so the retry waits for the lock
        # (RETRY_LOCK_WAIT_S) where a first attempt skips a held row as another
        # coordinator's; skipping it would leave the due slots to a later pass.
        retry = request.attempt()
        with self.engine.pool.connection() as conn, conn.transaction():
            now = clock.now(conn)
            row = repo.lock_due(conn, schedule_id, now, wait_s=RETRY_LOCK_WAIT_S if retry else None)
            if row is None:
                result.contended += 1
                return
            zone = rules.check_zone(row.timezone)
            due, following = rules.due_slots(row.cron, zone, row.next_slot_at, now, SLOTS_PER_PASS)
            previous_active = row.last_run_id is not None and repo.run_active(conn, row.last_run_id)
            plan = rules.plan_pass(
                rules.Schedule(id=row.id, name=row.name, cron=row.cron, timezone=row.timezone, overlap=row.overlap,
                               catchup=row.catchup, next_slot_at=row.next_slot_at,
                               buffered_slot_at=row.buffered_slot_at),
                due, following, now=now, previous_active=previous_active, grace=grace, max_starts=max_starts,
                buffer_poll=buffer_poll)
            events: list[ScheduleEvent] = []
            started, buffered, missed, skipped, last_missed, reason = 0, 0, 0, 0, None, None
            for slot in plan.start:
                run_id, refused = self._start_slot(conn, now, row, slot, "cron", "cron", request)
                if refused is not None:
                    events.append(ScheduleEvent(kind="missed", source="cron", first_slot_at=slot, last_slot_at=slot,
                                                run_id=run_id, reason=refused))
                    missed, last_missed, reason = missed + 1, max(slot, last_missed or slot), refused
                    continue
                repo.set_last_run(conn, row.id, slot=slot, run_id=run_id, now=now)
                events.append(ScheduleEvent(kind="started", source="cron", first_slot_at=slot, last_slot_at=slot,
                                            run_id=run_id))
                started += 1
            if plan.buffered is not None and plan.buffered != row.buffered_slot_at:
                events.append(ScheduleEvent(kind="buffered", source="cron", first_slot_at=plan.buffered,
                                            last_slot_at=plan.buffered,
                                            reason="overlap buffer_one: the previous run was still active"))
                buffered += 1
            for out in plan.not_started:
                events.append(ScheduleEvent(kind=out.kind, source="cron", first_slot_at=out.first,
                                            last_slot_at=out.last, slots=out.count, reason=out.reason))
                if out.kind == "missed":
                    missed, last_missed = missed + out.count, max(out.last, last_missed or out.last)
                else:
                    skipped += out.count
                reason = out.reason
            repo.record(conn, row.id, events, now)
            repo.advance(conn, row.id, next_slot_at=plan.next_slot_at, wake_at=plan.wake_at,
                         buffered_slot_at=plan.buffered, missed=missed, skipped=skipped, last_missed=last_missed,
                         reason=reason, now=now)
        # Counted once committed: a pass retried after a lost acknowledgement finds nothing due.
        result.started += started
        result.buffered += buffered
        result.missed += missed
        result.skipped += skipped

    def _start_slot(self, conn: Any, now: datetime, row: ScheduleRow, slot: datetime, kind: str, source: str,
                    request: Request) -> tuple[str, str | None]:
        """Start the run of ``slot`` (its ID derived from the schedule, ``kind`` and the
        slot) through the engine's start; ``(run_id, None)`` when it started or had
        started already, ``(run_id, why)`` when it cannot start (the workflow is
        disabled or deleted, the slot's month has no partition)."""
        run_id = rules.slot_run_id(row.id, kind, slot)
        try:
            partitions.require_run_partition(conn, run_id)
        except Invalid:
            return run_id, f"slot {_iso(slot)} falls in month {month_of(run_id)}, which has no partition"
        detail = {"schedule": row.name, "schedule_id": row.id, "slot": _iso(slot), "source": source}
        try:
            start_in(conn, self.engine.shell, workflow_id=row.workflow_id, version=None,
                     input=slot_input(row.input, row.name, slot, source), run_id=run_id, minted=[],
                     request=request, started_detail=detail, derived=True)
        except Conflict:
            # The slot's run exists: another coordinator, an earlier attempt, or a backfill started it.
            log.info("schedule %s slot %s: run %s had started already", row.name, _iso(slot), run_id)
        except (Invalid, NotFound) as exc:
            # The workflow is disabled, deleted or gone: refused before anything was written.
            return run_id, str(exc)
        return run_id, None
