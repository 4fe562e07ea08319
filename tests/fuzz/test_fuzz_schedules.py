"""Schedule slots under generated cron expressions, zones and windows around daylight-
saving transitions: every slot between two instants exactly once, whatever instant an
iteration starts from, and the same set a brute-force reading of the zone gives."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

from hypothesis import example, given
from hypothesis import strategies as st

from composer_ops.core.schedules import (
    Schedule,
    check_cron,
    check_zone,
    due_slots,
    next_slot,
    plan_pass,
    slot_run_id,
    slots_between,
)
from tests.fuzz.conftest import examples

MINUTES = ["0", "30", "15,45", "*/15", "*/20", "*", "5-10", "59"]
HOURS = ["2", "1,2,3", "*", "*/2", "2-3", "0", "3"]
ZONES = ["Europe/Paris", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "UTC"]
#: Instants near the 2026 transitions of those zones (the windows are drawn around them).
CENTRES = [datetime(2026, 3, 29, 1, tzinfo=UTC), datetime(2026, 10, 25, 1, tzinfo=UTC),
           datetime(2026, 3, 8, 7, tzinfo=UTC), datetime(2026, 11, 1, 6, tzinfo=UTC),
           datetime(2026, 4, 4, 15, tzinfo=UTC), datetime(2026, 10, 3, 15, 30, tzinfo=UTC)]
NO_LIMIT = 1_000_000


def _field(spec: str, high: int) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        if part.startswith("*"):
            step = int(part[2:]) if "/" in part else 1
            out |= set(range(0, high, step))
        elif "-" in part:
            lo, hi = part.split("-")
            out |= set(range(int(lo), int(hi) + 1))
        else:
            out.add(int(part))
    return out


def oracle(minute: str, hour: str, zone: ZoneInfo, after: datetime, until: datetime) -> list[datetime]:
    """The slots by brute force. A job at fixed times (neither field a wildcard) fires
    once per local date and matching wall time: in the first pass of a repeated hour,
    and at the first minute that exists after a wall time that does not. Otherwise at
    every real minute whose wall time matches."""
    minutes, hours = _field(minute, 60), _field(hour, 24)
    found: set[datetime] = set()
    if not minute.startswith("*") and not hour.startswith("*"):
        day = (after.astimezone(zone) - timedelta(days=1)).date()
        while day <= (until.astimezone(zone) + timedelta(days=1)).date():
            for h in sorted(hours):
                for m in sorted(minutes):
                    wall = datetime.combine(day, time(h, m))
                    local = wall.replace(tzinfo=zone, fold=0)
                    while local.astimezone(UTC).astimezone(zone).replace(tzinfo=None) != wall:   # does not exist
                        wall += timedelta(minutes=1)
                        local = wall.replace(tzinfo=zone, fold=0)
                    found.add(local.astimezone(UTC))
            day += timedelta(days=1)
    else:
        at = after.replace(second=0, microsecond=0)
        while at <= until:
            local = at.astimezone(zone)
            if local.minute in minutes and local.hour in hours:
                found.add(at)
            at += timedelta(minutes=1)
    return sorted(s for s in found if after < s <= until)


# Offsets of a few hours as often as of days: a pass that stops inside the transition
# (in the second pass of a repeated hour, before the slot's minute) is the hard case.
_near = st.integers(-3 * 3600, 3 * 3600)
windows = st.tuples(st.sampled_from(CENTRES), st.one_of(_near, st.integers(-36 * 3600, 36 * 3600)),
                    st.one_of(st.integers(0, 3 * 3600), st.integers(0, 2 * 86400)), st.integers(0, 2 * 86400))


@examples(150)
@given(st.sampled_from(MINUTES), st.sampled_from(HOURS), st.sampled_from(ZONES), windows)
def test_every_slot_between_two_instants_exactly_once(minute: str, hour: str, zone_name: str,
                                                      window: tuple[datetime, int, int, int]) -> None:
    centre, shift, first, second = window
    a = centre + timedelta(seconds=shift)
    b = a + timedelta(seconds=first)
    c = b + timedelta(seconds=second)
    cron = check_cron(f"{minute} {hour} * * *")
    zone = check_zone(zone_name)
    whole = slots_between(cron, zone, a, c, NO_LIMIT)
    assert whole == sorted(set(whole))                       # strictly increasing: none twice
    assert all(a < s <= c for s in whole)
    # Wherever a pass stops, the next one, starting from that instant, names each slot once.
    assert slots_between(cron, zone, a, b, NO_LIMIT) + slots_between(cron, zone, b, c, NO_LIMIT) == whole
    assert whole == oracle(minute, hour, zone, a, c)


@examples(100)
@given(st.text(min_size=1, max_size=20), st.sampled_from(["cron", "trigger"]),
       st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)))
def test_a_slot_names_one_run_id_in_its_own_month(schedule_id: str, kind: str, slot: datetime) -> None:
    run_id = slot_run_id(schedule_id, kind, slot)
    assert run_id == slot_run_id(schedule_id, kind, slot)
    assert run_id[14] == "7" and run_id[19] in "89ab"
    assert int(run_id[:8] + run_id[9:13], 16) == (slot - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
    other = "trigger" if kind == "cron" else "cron"
    assert slot_run_id(schedule_id, other, slot) != run_id


def test_paris_spring_forward_and_repeated_hour() -> None:
    """The two days the issue names, read by hand from the zone."""
    paris = check_zone("Europe/Paris")
    spring = slots_between("30 2 * * *", paris, datetime(2026, 3, 28, 12, tzinfo=UTC),
                           datetime(2026, 3, 30, 12, tzinfo=UTC), 10)
    # 2026-03-29 02:30 does not exist: 03:00 CEST (01:00Z); the next day 02:30 CEST (00:30Z).
    assert spring == [datetime(2026, 3, 29, 1, tzinfo=UTC), datetime(2026, 3, 30, 0, 30, tzinfo=UTC)]
    autumn = slots_between("30 2 * * *", paris, datetime(2026, 10, 24, 12, tzinfo=UTC),
                           datetime(2026, 10, 26, 12, tzinfo=UTC), 10)
    # 2026-10-25 02:30 happens twice (CEST 00:30Z, CET 01:30Z): once, the first; then CET.
    assert autumn == [datetime(2026, 10, 25, 0, 30, tzinfo=UTC), datetime(2026, 10, 26, 1, 30, tzinfo=UTC)]
    quarter = slots_between("*/30 * * * *", paris, datetime(2026, 10, 25, 0, tzinfo=UTC),
                            datetime(2026, 10, 25, 2, tzinfo=UTC), 10)
    assert [s.astimezone(paris).strftime("%H:%M%z") for s in quarter] == [
        "02:30+0200", "02:00+0100", "02:30+0100", "03:00+0100"]
    assert date(2026, 10, 25) == quarter[0].astimezone(paris).date()


def test_a_pass_stopping_in_the_repeated_hour_names_no_slot_again() -> None:
    """From 02:40 CET (the second pass of 2026-10-25's 02:00 hour) the wall clock's next
    02:45 is the first pass's, already behind: the next slot is the next day's."""
    paris = check_zone("Europe/Paris")
    after = datetime(2026, 10, 25, 1, 40, tzinfo=UTC)
    assert slots_between("45 2 * * *", paris, after, after + timedelta(days=1, hours=1), 10) == [
        datetime(2026, 10, 26, 1, 45, tzinfo=UTC)]


@examples(100)
@given(st.sampled_from(["*/5 * * * *", "30 2 * * *", "0,30 1-3 * * *", "*/20 2 * * *"]),
       st.sampled_from(ZONES), st.sampled_from(CENTRES),
       st.lists(st.one_of(st.integers(1, 600), st.integers(1800, 4 * 3600)), min_size=1, max_size=12),
       st.integers(1, 4), st.sampled_from(["all", "latest", "none"]))
@example("*/5 * * * *", "Europe/Paris", CENTRES[0], [3600], 1, "all")      # a pass capped at one start
def test_passes_decide_every_slot_once(cron: str, zone_name: str, centre: datetime, gaps: list[int],
                                       max_starts: int, catchup: str) -> None:
    """Passes at random instants (a coordinator late by up to hours, starts capped per
    pass), moving the cursor as the coordinator does: every slot up to the last pass is
    started or not started exactly once, in order, and catch-up ``all`` starts them all."""
    zone = check_zone(zone_name)
    created = centre - timedelta(hours=3)
    cursor = next_slot(cron, zone, created)
    schedule = Schedule(id="s", name="s", cron=cron, timezone=zone_name, overlap="allow", catchup=catchup,
                        next_slot_at=cursor)
    decided: list[datetime] = []
    now = created
    for gap in gaps:
        now += timedelta(seconds=gap)
        due, following = due_slots(cron, zone, cursor, now, 50)
        plan = plan_pass(schedule, due, following, now=now, previous_active=False, grace=timedelta(seconds=60),
                         max_starts=max_starts, buffer_poll=timedelta(seconds=5))
        missed = [s for o in plan.not_started for s in due if o.first <= s <= o.last]
        assert catchup != "all" or not missed
        decided += sorted(plan.start + missed)
        assert plan.next_slot_at is None or plan.next_slot_at > max(plan.start + missed, default=created)
        cursor = plan.next_slot_at
        schedule = Schedule(id="s", name="s", cron=cron, timezone=zone_name, overlap="allow", catchup=catchup,
                            next_slot_at=cursor)
    assert decided == sorted(set(decided))                          # none twice, in order
    assert decided == slots_between(cron, zone, created, (cursor or now) - timedelta(microseconds=1), NO_LIMIT)
