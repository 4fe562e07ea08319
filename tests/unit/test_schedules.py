"""The pure rules of schedules (composer_ops/core/schedules.py): what is refused at
create, and what one pass does with due slots under each catch-up and overlap policy."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from composer_ops.core.schedules import Schedule, check_cron, check_name, check_policy, check_zone, plan_pass
from composer_ops.errors import Invalid

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


@pytest.mark.parametrize(("expr", "message"), [
    ("61 * * * *", "field 1 (minute) '61'"),
    ("* 24 * * *", "field 2 (hour) '24'"),
    ("* * 0 * *", "field 3 (day-of-month) '0'"),
    ("* * * 13 *", "field 4 (month) '13'"),
    ("* * * * 8", "field 5 (day-of-week) '8'"),
    ("0 2 * *", "has 4 field(s); it needs 5"),
    ("0 0 2 * * *", "has 6 field(s)"),
    ("0 0 30 2 *", "day-of-month '30' never occurs in month '2'"),
    ("@daily", "has 1 field(s)"),
])
def test_a_bad_cron_is_one_line_naming_the_field(expr: str, message: str) -> None:
    with pytest.raises(Invalid, match=re.escape(message)) as caught:
        check_cron(expr)
    assert "\n" not in str(caught.value)


def test_a_good_cron_is_normalised() -> None:
    assert check_cron("  0   2 * *  1-5 ") == "0 2 * * 1-5"


@pytest.mark.parametrize("zone", ["Mars/Olympus", "", "../etc/passwd", "Europe/Paris\n", 42])
def test_an_unknown_zone_is_refused(zone: object) -> None:
    with pytest.raises(Invalid, match="time zone"):
        check_zone(zone)


def test_policies_and_names() -> None:
    assert check_policy("overlap", "buffer_one") == "buffer_one"
    with pytest.raises(Invalid, match="overlap 'sometimes' is not one of skip, buffer_one, allow"):
        check_policy("overlap", "sometimes")
    with pytest.raises(Invalid, match="catchup 'some' is not one of none, latest, all"):
        check_policy("catchup", "some")
    with pytest.raises(Invalid, match="schedule name"):
        check_name("has space")


def _schedule(overlap: str = "allow", catchup: str = "all", buffered: datetime | None = None) -> Schedule:
    return Schedule(id="s", name="n", cron="*/10 * * * *", timezone="UTC", overlap=overlap, catchup=catchup,
                    next_slot_at=T0, buffered_slot_at=buffered)


HOUR = [T0 + timedelta(minutes=10 * i) for i in range(7)]          # 10:00 ... 11:00
NOW = T0 + timedelta(hours=1, seconds=5)
FOLLOWING = T0 + timedelta(minutes=70)


def test_catchup_all_starts_every_slot_after_an_outage() -> None:
    plan = plan_pass(_schedule(), HOUR, FOLLOWING, now=NOW, previous_active=False, grace=timedelta(seconds=60),
                     max_starts=100, buffer_poll=timedelta(seconds=5))
    assert plan.start == HOUR and not plan.not_started
    assert plan.next_slot_at == plan.wake_at == FOLLOWING


def test_catchup_latest_starts_the_newest_and_misses_the_rest() -> None:
    plan = plan_pass(_schedule(catchup="latest"), HOUR, FOLLOWING, now=NOW, previous_active=False,
                     grace=timedelta(seconds=60), max_starts=100, buffer_poll=timedelta(seconds=5))
    assert plan.start == [HOUR[-1]]
    [missed] = plan.not_started
    assert (missed.kind, missed.first, missed.last, missed.count) == ("missed", HOUR[0], HOUR[-2], 6)


def test_catchup_latest_cut_short_misses_all_it_saw() -> None:
    """The pass saw only part of the due slots (``following`` is due too): none of them is the latest."""
    plan = plan_pass(_schedule(catchup="latest"), HOUR[:3], HOUR[3], now=NOW, previous_active=False,
                     grace=timedelta(seconds=60), max_starts=100, buffer_poll=timedelta(seconds=5))
    assert plan.start == [] and plan.not_started[0].count == 3 and plan.next_slot_at == HOUR[3]


def test_catchup_none_starts_only_slots_within_the_grace() -> None:
    plan = plan_pass(_schedule(catchup="none"), HOUR, FOLLOWING, now=NOW, previous_active=False,
                     grace=timedelta(seconds=60), max_starts=100, buffer_poll=timedelta(seconds=5))
    assert plan.start == [HOUR[-1]]
    assert plan.not_started[0].count == 6 and "catchup none" in plan.not_started[0].reason


def test_overlap_skip_judges_the_previous_run_then_each_run_it_starts() -> None:
    plan = plan_pass(_schedule(overlap="skip"), HOUR[:2], HOUR[2], now=HOUR[1], previous_active=False,
                     grace=timedelta(seconds=60), max_starts=100, buffer_poll=timedelta(seconds=5))
    assert plan.start == [HOUR[0]] and plan.not_started[0].kind == "skipped"
    plan = plan_pass(_schedule(overlap="skip"), HOUR[:1], HOUR[1], now=HOUR[0], previous_active=True,
                     grace=timedelta(seconds=60), max_starts=100, buffer_poll=timedelta(seconds=5))
    assert plan.start == [] and plan.not_started[0].reason.startswith("overlap skip")


def test_overlap_buffer_one_keeps_one_slot_until_the_run_finishes() -> None:
    s = _schedule(overlap="buffer_one")
    plan = plan_pass(s, HOUR[:2], HOUR[2], now=HOUR[1], previous_active=True, grace=timedelta(seconds=60),
                     max_starts=100, buffer_poll=timedelta(seconds=5))
    assert plan.start == [] and plan.buffered == HOUR[0]
    assert plan.not_started[0].kind == "skipped" and plan.not_started[0].first == HOUR[1]
    assert plan.wake_at == HOUR[1] + timedelta(seconds=5)            # polls for the run's end
    later = _schedule(overlap="buffer_one", buffered=HOUR[0])
    still = plan_pass(later, [], HOUR[2], now=HOUR[1] + timedelta(minutes=1), previous_active=True,
                      grace=timedelta(seconds=60), max_starts=100, buffer_poll=timedelta(seconds=5))
    assert still.start == [] and still.buffered == HOUR[0] and not still.not_started
    done = plan_pass(later, [], HOUR[2], now=HOUR[1] + timedelta(minutes=2), previous_active=False,
                     grace=timedelta(seconds=60), max_starts=100, buffer_poll=timedelta(seconds=5))
    assert done.start == [HOUR[0]] and done.buffered is None and done.wake_at == HOUR[2]


def test_max_starts_leaves_the_cursor_on_the_first_slot_not_started() -> None:
    plan = plan_pass(_schedule(), HOUR, FOLLOWING, now=NOW, previous_active=False, grace=timedelta(seconds=60),
                     max_starts=2, buffer_poll=timedelta(seconds=5))
    assert plan.start == HOUR[:2] and plan.next_slot_at == HOUR[2] and not plan.not_started


def test_late_means_overdue_past_the_threshold_or_the_newest_slot_missed() -> None:
    from composer_ops.core.schedules import late_reason

    def late(**kw: object) -> str | None:
        base: dict[str, object] = {"paused": False, "next_slot_at": T0, "last_slot_at": None,
                                   "last_missed_slot_at": None, "last_not_started_reason": None,
                                   "now": T0 + timedelta(seconds=200), "threshold": timedelta(seconds=300)}
        return late_reason(**{**base, **kw})  # type: ignore[arg-type]

    assert late() is None
    assert "is 301s overdue" in (late(now=T0 + timedelta(seconds=301)) or "")
    assert late(now=T0 + timedelta(days=1), paused=True) is None
    missed = T0 - timedelta(hours=1)
    assert "was missed: disabled" in (late(last_missed_slot_at=missed, last_not_started_reason="disabled") or "")
    assert late(last_missed_slot_at=missed, last_slot_at=T0 - timedelta(minutes=1)) is None
