"""Schedules: a cron expression read in a time zone, its slots, the run ID of a slot,
and what one coordinator pass does with the slots that are due. Pure: the database
clock is passed in.

Slots follow Debian cron in the schedule's zone (the ``cronsim`` library): a job at a
fixed time of day whose local time does not exist on a spring-forward day (02:30 on
2026-03-29 in Europe/Paris) fires at the first minute that exists after it (03:00
CEST, once); on the autumn day whose hour repeats it fires in the first pass of that
hour only (02:30 CEST, not again at 02:30 CET). An expression whose minute or hour is
a wildcard (``*/15 * * * *``, ``0 * * * *``) fires at every matching instant that
exists: none in the skipped hour, both passes of the repeated one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from composer_ops.core.spec import ID_PATTERN
from composer_ops.errors import Invalid

__all__ = [
    "CATCHUP_POLICIES",
    "OVERLAP_POLICIES",
    "SLOT_KINDS",
    "Plan",
    "Schedule",
    "check_cron",
    "check_name",
    "check_policy",
    "check_zone",
    "due_slots",
    "iter_slots",
    "late_reason",
    "next_slot",
    "plan_pass",
    "slot_run_id",
    "slots_between",
]

OVERLAP_POLICIES = ("skip", "buffer_one", "allow")
CATCHUP_POLICIES = ("none", "latest", "all")
#: What made a run of a schedule: a cron slot (fired on time, caught up or backfilled:
#: one run per slot whichever did it) or ``schedules trigger``.
SLOT_KINDS = ("cron", "trigger")

_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def check_name(name: object) -> str:
    """A schedule name: 1 to 128 of ``A-Z a-z 0-9 _ . -`` (as a workflow id)."""
    if not isinstance(name, str) or not ID_PATTERN.fullmatch(name):
        shown = repr(name) if isinstance(name, str) else type(name).__name__
        raise Invalid(f"schedule name {shown[:60]} is not a name (1 to 128 of A-Z a-z 0-9 _ . -)")
    return name


def check_cron(expr: object) -> str:
    """``expr`` with its fields separated by one space, or :class:`Invalid` naming the
    field that is wrong. Five fields: minute hour day-of-month month day-of-week."""
    if not isinstance(expr, str):
        raise Invalid(f"cron must be a string of 5 fields ({' '.join(_FIELDS)}), got {type(expr).__name__}")
    parts = expr.split()
    if len(parts) != 5:
        raise Invalid(f"cron {expr!r} has {len(parts)} field(s); it needs 5: {' '.join(_FIELDS)}")
    for i, part in enumerate(parts):
        # Each field alone, so the error names the first bad one in the order written.
        probe = ["*"] * 5
        probe[i] = part
        try:
            CronSim(" ".join(probe), datetime(2000, 1, 1))
        except CronSimError:
            raise Invalid(f"cron {expr!r}: field {i + 1} ({_FIELDS[i]}) {part!r} is not valid") from None
    normal = " ".join(parts)
    try:
        CronSim(normal, datetime(2000, 1, 1))
    except CronSimError as exc:    # each field is valid alone; together they never match (Feb 30)
        raise Invalid(f"cron {expr!r}: day-of-month {parts[2]!r} never occurs in month {parts[3]!r} "
                      f"({str(exc).lower()})") from None
    return normal


def check_zone(name: object) -> ZoneInfo:
    """The IANA time zone ``name`` (``Europe/Paris``, ``UTC``), or :class:`Invalid`."""
    if not isinstance(name, str) or not name or len(name) > 64 or not name.isprintable():
        raise Invalid(f"time zone {name!r} is not an IANA time zone name like Europe/Paris or UTC")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise Invalid(f"time zone {name!r} is unknown (an IANA name like Europe/Paris or UTC)") from None


def check_policy(kind: str, value: object) -> str:
    """``value`` if it is one of the ``kind`` ("overlap" or "catchup") policies."""
    allowed = OVERLAP_POLICIES if kind == "overlap" else CATCHUP_POLICIES
    if value not in allowed:
        raise Invalid(f"{kind} {value!r} is not one of {', '.join(allowed)}")
    return str(value)


def _aware(ts: datetime, name: str) -> None:
    if ts.tzinfo is None or ts.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime, got {ts!r}")


def iter_slots(cron: str, zone: ZoneInfo, after: datetime) -> Iterator[datetime]:
    """The slots strictly after ``after``, in UTC, strictly increasing.

    Started from the local time of ``after``, the library may name a slot at or before
    it (in the second pass of a repeated hour it reads the wall clock, whose first pass
    is earlier): such slots were already due, so they are dropped here. Whatever
    instant the iteration starts from, a slot is therefore named once."""
    _aware(after, "after")
    last = after.astimezone(UTC)
    for local in CronSim(cron, after.astimezone(zone).replace(microsecond=0)):
        slot = local.astimezone(UTC)
        if slot > last:
            last = slot
            yield slot


def next_slot(cron: str, zone: ZoneInfo, after: datetime) -> datetime | None:
    """The first slot strictly after ``after``; None when there is none (in 50 years)."""
    return next(iter_slots(cron, zone, after), None)


def slots_between(cron: str, zone: ZoneInfo, after: datetime, until: datetime, limit: int) -> list[datetime]:
    """The slots ``s`` with ``after < s <= until``, at most ``limit`` of them, oldest first."""
    _aware(until, "until")
    out: list[datetime] = []
    for slot in iter_slots(cron, zone, after):
        if slot > until or len(out) >= limit:
            break
        out.append(slot)
    return out


def due_slots(cron: str, zone: ZoneInfo, cursor: datetime | None, now: datetime,
              limit: int) -> tuple[list[datetime], datetime | None]:
    """The slots a pass at ``now`` looks at, from the cursor (the first slot not decided
    yet) on, at most ``limit`` of them, and the slot after them (the next cursor when
    the pass decides them all; None when the cron has no later slot)."""
    if cursor is None or cursor > now:
        return [], cursor
    due = [cursor, *slots_between(cron, zone, cursor, now, limit - 1)]
    return due, next_slot(cron, zone, due[-1])


def slot_run_id(schedule_id: str, kind: str, slot: datetime) -> str:
    """The run ID of a schedule's slot: a UUIDv7 whose timestamp is the slot's
    millisecond (so the run lives in its slot's month) and whose other 74 bits are a
    hash of the schedule, the kind and that millisecond. Two coordinators, or a start
    retried after a lost acknowledgement, name the same run, which the runs' primary
    key admits once."""
    _aware(slot, "slot")
    if kind not in SLOT_KINDS:
        raise ValueError(f"slot kind {kind!r} is not one of {SLOT_KINDS}")
    ms = (slot - _EPOCH) // timedelta(milliseconds=1)
    if not 0 <= ms < 1 << 48:
        raise Invalid(f"slot {slot.isoformat()} is outside what a UUIDv7 can name")
    digest = hashlib.sha256(f"{schedule_id}\x00{kind}\x00{ms}".encode()).digest()
    value = (ms << 80) | (int.from_bytes(digest[:10], "big") & ((1 << 80) - 1))
    value = (value & ~(0xF << 76)) | (0x7 << 76)   # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)   # RFC 9562 variant
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """What a pass needs of a schedule row."""

    id: str
    name: str
    cron: str
    timezone: str
    overlap: str
    catchup: str
    next_slot_at: datetime | None
    buffered_slot_at: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """A slot that did not start, and why: ``missed`` (catch-up policy) or ``skipped``
    (overlap policy)."""

    kind: str
    first: datetime
    last: datetime
    count: int
    reason: str


@dataclass(kw_only=True)
class Plan:
    """What a pass does with one schedule: the slots to start, in order; the slots not
    started and why (runs of consecutive slots with one reason folded into one entry);
    the slot buffered behind the active run (``buffer_one``); where the slot cursor
    goes; and when the schedule needs a pass again (None: never, unless changed)."""

    start: list[datetime] = field(default_factory=list)
    not_started: list[Outcome] = field(default_factory=list)
    buffered: datetime | None = None
    next_slot_at: datetime | None = None
    wake_at: datetime | None = None

    def note(self, kind: str, slot: datetime, reason: str) -> None:
        last = self.not_started[-1] if self.not_started else None
        if last is not None and last.kind == kind and last.reason == reason:
            self.not_started[-1] = Outcome(kind=kind, first=last.first, last=slot, count=last.count + 1,
                                           reason=reason)
        else:
            self.not_started.append(Outcome(kind=kind, first=slot, last=slot, count=1, reason=reason))


def plan_pass(schedule: Schedule, due: Sequence[datetime], following: datetime | None, *, now: datetime,
              previous_active: bool, grace: timedelta, max_starts: int, buffer_poll: timedelta) -> Plan:
    """Decide one pass over ``schedule`` at the database clock ``now``.

    ``due`` are the slots from the schedule's cursor up to ``now`` (oldest first, possibly
    cut short: then ``following`` is the first slot left out), ``following`` the slot
    after them. ``previous_active``: the schedule's last run is still active. Catch-up:
    ``all`` starts every due slot, ``latest`` the newest only, ``none`` only slots less
    than ``grace`` old; the rest are missed. Overlap, judged against the previous run and
    then against each run this pass starts: ``allow`` starts anyway, ``skip`` skips the
    slot, ``buffer_one`` keeps the first such slot to start when the active run has
    finished and skips the others. At most ``max_starts`` runs start; the cursor then
    stays on the first slot not looked at."""
    _aware(now, "now")
    plan = Plan(buffered=schedule.buffered_slot_at)
    active = previous_active
    if plan.buffered is not None and not active:
        plan.start.append(plan.buffered)
        plan.buffered = None
        active = True
    complete = following is None or following > now
    cursor: datetime | None = following
    for i, slot in enumerate(due):
        newest = complete and i == len(due) - 1
        if schedule.catchup == "latest" and not newest:
            plan.note("missed", slot, "catchup latest: a later slot was due when the coordinator got to it")
            continue
        if schedule.catchup == "none" and now - slot > grace:
            plan.note("missed", slot, f"catchup none: due more than {_seconds(grace)} before the coordinator "
                                      "got to it")
            continue
        if active and schedule.overlap != "allow":
            if schedule.overlap == "buffer_one" and plan.buffered is None:
                plan.buffered = slot
            else:
                why = "a slot is already buffered" if schedule.overlap == "buffer_one" else "overlap skip"
                plan.note("skipped", slot, f"{why}: the previous run was still active")
            continue
        if len(plan.start) >= max_starts:
            cursor = slot
            break
        plan.start.append(slot)
        active = True
    plan.next_slot_at = cursor
    plan.wake_at = cursor
    if plan.buffered is not None:
        poll = now + buffer_poll
        plan.wake_at = poll if cursor is None else min(cursor, poll)
    return plan


def late_reason(*, paused: bool, next_slot_at: datetime | None, last_slot_at: datetime | None,
                last_missed_slot_at: datetime | None, last_not_started_reason: str | None, now: datetime,
                threshold: timedelta, duration: Callable[[float], str] | None = None) -> str | None:
    """Why a schedule's last due slot did not start (None: it did, or none is due): its
    cursor is more than ``threshold`` behind the clock (no coordinator decided the slot),
    or the newest slot decided was missed and none started after it. A paused schedule
    is never late; an overlap skip is the policy working, not a miss. ``duration`` writes
    the seconds overdue (the reports' and ``check``'s
    :func:`composer_ops.ops.display.duration`; None: ``360s``)."""
    if paused:
        return None
    if next_slot_at is not None and now - next_slot_at > threshold:
        late = now - next_slot_at
        return (f"slot {next_slot_at.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ} is "
                f"{duration(late.total_seconds()) if duration else _seconds(late)} "
                "overdue: is a coordinator running the schedules loop?")
    if last_missed_slot_at is not None and (last_slot_at is None or last_missed_slot_at > last_slot_at):
        return (f"slot {last_missed_slot_at.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ} was missed: "
                f"{last_not_started_reason or 'no reason recorded'}")
    return None


def _seconds(delta: timedelta) -> str:
    return f"{delta.total_seconds():g}s"
