"""UUIDv7 run IDs: shape, recency against the database clock, partition bounds."""

from __future__ import annotations

import calendar
import math
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest
import uuid6
from hypothesis import given
from hypothesis import strategies as st

from composer_ops.core.runids import (
    RUN_ID_MAX_AGE,
    RUN_ID_MAX_AHEAD,
    RUN_START_SLACK,
    active_ceiling,
    active_floor,
    add_months,
    month_bounds,
    month_label,
    month_of,
    month_start,
    uuid7_bound,
    uuid7_timestamp,
    validate_run_id,
)
from composer_ops.errors import Invalid

from .refusals import refusal

NOW = datetime(2026, 5, 17, 12, 0, 0, tzinfo=UTC)


def mint(ts: datetime, tail: str = "7abc-9def-0123456789ab") -> str:
    """A UUIDv7 with the given timestamp; ``tail`` sets version, variant and randomness."""
    ms = (calendar.timegm(ts.utctimetuple()) * 1000) + ts.microsecond // 1000
    h = f"{ms:012x}"
    return f"{h[:8]}-{h[8:]}-{tail}"


def sql_uuid7_bound(ts: datetime) -> str:
    """The SQL function, transcribed: floor(extract(epoch FROM ts) * 1000), to_hex, lpad."""
    epoch = Decimal(calendar.timegm(ts.astimezone(UTC).utctimetuple())) + Decimal(ts.microsecond) / 10**6
    ms = math.floor(epoch * 1000)
    hex_text = format(ms if ms >= 0 else ms + 2**64, "x")
    h = hex_text.rjust(12, "0")[:12]
    return h[0:8] + "-" + h[8:12] + "-0000-0000-000000000000"


def test_accepts_a_fresh_uuid7() -> None:
    run_id = mint(NOW - timedelta(minutes=10))
    assert validate_run_id(run_id, NOW) == run_id
    assert uuid7_timestamp(run_id) == NOW - timedelta(minutes=10)


def test_accepts_uuid6_package_output() -> None:
    run_id = str(uuid6.uuid7())
    minted = uuid7_timestamp(run_id)
    assert validate_run_id(run_id, minted + timedelta(seconds=1)) == run_id


@pytest.mark.parametrize(
    ("run_id", "fragment"),
    [
        ("not-a-uuid", "not a canonical UUID"),
        ("", "not a canonical UUID"),
        ("0190b6c85a3e7d2c9f1e3b4a5c6d7e8f", "not a canonical UUID"),
        ("{0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e8f}", "not a canonical UUID"),
        ("0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e8", "not a canonical UUID"),
        ("0190b6c8-5a3e7-d2c-9f1e-3b4a5c6d7e8f", "not a canonical UUID"),
        ("0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e8g", "not a canonical UUID"),
        ("0190B6C8-5A3E-7D2C-9F1E-3B4A5C6D7E8F", "lowercase"),
        ("0190b6c8-5a3e-4d2c-9f1e-3b4a5c6d7e8f", "version 4"),
        ("0190b6c8-5a3e-7d2c-cf1e-3b4a5c6d7e8f", "variant"),
        ("0190b6c8-5a3e-7d2c-7f1e-3b4a5c6d7e8f", "variant"),
    ],
)
def test_rejects_malformed(run_id: str, fragment: str) -> None:
    assert fragment in refusal(validate_run_id, run_id, NOW)


def test_rejects_non_string() -> None:
    with pytest.raises(Invalid, match="string"):
        validate_run_id(123, NOW)


def test_without_a_clock_only_the_shape_is_checked() -> None:
    ancient = mint(NOW - timedelta(days=3650))
    assert validate_run_id(ancient) == ancient
    with pytest.raises(Invalid, match="lowercase"):
        validate_run_id(ancient.upper())


@pytest.mark.parametrize("spelling", ["{ID}", "  ID ", "urn:uuid:ID", "UPPER", "ID"])
def test_normalise_accepts_what_a_person_pastes_and_returns_the_canonical_text(spelling: str) -> None:
    run_id = mint(NOW)
    text = run_id.upper() if spelling == "UPPER" else spelling.replace("ID", run_id)
    assert validate_run_id(text, normalise=True) == run_id


@pytest.mark.parametrize(("value", "fragment"), [("not-a-uuid", "run_id 'not-a-uuid' is not a UUID"),
                                                  (42, "run_id must be a UUID string"),
                                                  ("0190b6c8-5a3e-4d2c-9f1e-3b4a5c6d7e8f", "version 4")])
def test_normalise_still_refuses_what_is_not_a_uuid7(value: object, fragment: str) -> None:
    assert fragment in refusal(validate_run_id, value, normalise=True, name="run_id")


def test_rejects_old_ids() -> None:
    run_id = mint(NOW - timedelta(hours=1, seconds=1))
    message = refusal(validate_run_id, run_id, NOW)
    assert f"run id {run_id} was minted at 2026-05-17T10:59:59.000Z" in message
    assert "more than 1h before the database clock 2026-05-17T12:00:00.000Z" in message


def test_age_limit_is_inclusive_and_configurable() -> None:
    oldest = mint(NOW - timedelta(hours=1))
    assert validate_run_id(oldest, NOW) == oldest
    with pytest.raises(Invalid, match="more than 1m30s before"):
        validate_run_id(mint(NOW - timedelta(minutes=2)), NOW, max_age=timedelta(seconds=90))


def test_rejects_ids_from_the_future() -> None:
    run_id = mint(NOW + timedelta(minutes=6))
    with pytest.raises(Invalid, match="more than 5m after the database clock"):
        validate_run_id(run_id, NOW)
    ahead = mint(NOW + timedelta(minutes=4))
    assert validate_run_id(ahead, NOW) == ahead


def test_now_in_another_zone_is_the_same_instant() -> None:
    plus_two = NOW.astimezone(timezone(timedelta(hours=2)))
    run_id = mint(NOW - timedelta(minutes=1))
    assert validate_run_id(run_id, plus_two) == run_id
    with pytest.raises(Invalid, match="before the database clock"):
        validate_run_id(run_id, (NOW + timedelta(hours=1)).astimezone(timezone(timedelta(hours=2))))


def test_naive_now_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        validate_run_id(mint(NOW), NOW.replace(tzinfo=None))


def test_timestamp_and_month() -> None:
    ts = datetime(2025, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    run_id = mint(ts)
    assert uuid7_timestamp(run_id) == ts
    assert month_of(run_id) == "202512"
    assert month_of(mint(ts + timedelta(milliseconds=1))) == "202601"


@pytest.mark.parametrize(
    ("ts", "expected"),
    [
        (datetime(1970, 1, 1, tzinfo=UTC), "00000000-0000-0000-0000-000000000000"),
        (datetime(2024, 1, 1, tzinfo=UTC), "018cc251-f400-0000-0000-000000000000"),
        (datetime(2026, 6, 1, tzinfo=UTC), sql_uuid7_bound(datetime(2026, 6, 1, tzinfo=UTC))),
        (
            datetime(2026, 6, 1, 2, 0, tzinfo=timezone(timedelta(hours=2))),
            sql_uuid7_bound(datetime(2026, 6, 1, tzinfo=UTC)),
        ),
        (
            datetime(2024, 2, 29, 12, 34, 56, 789999, tzinfo=UTC),
            sql_uuid7_bound(datetime(2024, 2, 29, 12, 34, 56, 789999, tzinfo=UTC)),
        ),
        (datetime(1969, 12, 31, 23, 59, 59, 999500, tzinfo=UTC), "ffffffff-ffff-0000-0000-000000000000"),
    ],
)
def test_uuid7_bound_matches_sql(ts: datetime, expected: str) -> None:
    assert uuid7_bound(ts) == expected
    assert uuid7_bound(ts) == sql_uuid7_bound(ts)


@given(st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)))
def test_uuid7_bound_properties(ts: datetime) -> None:
    bound = uuid7_bound(ts)
    assert bound == sql_uuid7_bound(ts)
    floor_ms = ts.replace(microsecond=ts.microsecond // 1000 * 1000)
    # Every id minted in the bound's millisecond sorts at or after it, every id minted a
    # millisecond earlier sorts before it: exactly what a partition boundary needs.
    assert mint(floor_ms, "7000-8000-000000000000") >= bound
    assert mint(floor_ms - timedelta(milliseconds=1), "7fff-bfff-ffffffffffff") < bound
    assert uuid7_timestamp(bound[:14] + "7000-8000-000000000000") == floor_ms


def test_month_bounds() -> None:
    assert month_bounds("202512") == (
        uuid7_bound(datetime(2025, 12, 1, tzinfo=UTC)),
        uuid7_bound(datetime(2026, 1, 1, tzinfo=UTC)),
    )
    low, high = month_bounds("202602")
    assert low <= mint(datetime(2026, 2, 1, tzinfo=UTC)) < high
    assert low <= mint(datetime(2026, 2, 28, 23, 59, 59, 999000, tzinfo=UTC)) < high
    assert not mint(datetime(2026, 3, 1, tzinfo=UTC)) < high
    assert month_start("202602") == datetime(2026, 2, 1, tzinfo=UTC)
    for bad in ("2026-02", "202613", "202600", "abcdef", "２０２６０２"):
        with pytest.raises(Invalid):
            month_start(bad)


def test_month_arithmetic_crosses_years_both_ways() -> None:
    assert add_months("202612", 2) == "202702"
    assert add_months("202601", -1) == "202512"
    assert add_months("202603", -27) == "202312"
    assert add_months("202605", 0) == "202605"
    assert [add_months("202611", k) for k in range(4)] == ["202611", "202612", "202701", "202702"]
    with pytest.raises(Invalid, match="not YYYYMM"):
        add_months("2026-1", 1)


def test_month_label_is_the_utc_month() -> None:
    late_in_new_york = datetime(2026, 1, 31, 23, 30, tzinfo=timezone(timedelta(hours=-5)))
    assert month_label(late_in_new_york) == "202602"
    assert month_start(month_label(late_in_new_york)) == datetime(2026, 2, 1, tzinfo=UTC)
    with pytest.raises(ValueError, match="timezone-aware"):
        month_label(datetime(2026, 1, 1))


def test_the_active_floor_covers_a_start_begun_before_a_month_boundary() -> None:
    """A start whose transaction began at 00:59:59.9 on the 1st accepts an ID minted an
    hour before, in the previous month; a floor read 0.2 s later, before that start
    commits, must not be above it (it was, with the floor taken an hour before the read)."""
    began = datetime(2026, 12, 1, 0, 59, 59, 900000, tzinfo=UTC)
    run_id = mint(began - RUN_ID_MAX_AGE)
    validate_run_id(run_id, began)
    read_at = began + timedelta(milliseconds=200)
    assert run_id >= active_floor(read_at, None)
    assert month_bounds(month_label(read_at - RUN_ID_MAX_AGE))[0] > run_id   # the previous rule
    assert active_floor(read_at, None) == month_bounds("202611")[0]


@given(st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2199, 1, 1), timezones=st.just(UTC)),
       st.timedeltas(min_value=-RUN_ID_MAX_AGE, max_value=RUN_ID_MAX_AHEAD),
       st.timedeltas(min_value=timedelta(0), max_value=RUN_START_SLACK))
def test_the_active_floor_is_below_every_run_a_pending_start_can_create(began: datetime, minted_at: timedelta,
                                                                       open_for: timedelta) -> None:
    run_id = mint(began + minted_at, "7000-8000-000000000000")    # the least ID of that millisecond
    if minted_at >= -RUN_ID_MAX_AGE + timedelta(milliseconds=1):
        validate_run_id(run_id, began)
    assert run_id >= active_floor(began + open_for, None)


@given(st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2199, 1, 1), timezones=st.just(UTC)),
       st.datetimes(min_value=datetime(1990, 1, 1), max_value=datetime(2199, 1, 1), timezones=st.just(UTC)))
def test_the_active_floor_is_a_month_bound_at_or_below_the_oldest_active_run(now: datetime, oldest: datetime) -> None:
    run_id = mint(oldest)
    floor = active_floor(now, run_id)
    assert floor <= run_id
    assert floor in (month_bounds(month_of(run_id))[0], active_floor(now, None))


@given(st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2199, 1, 1), timezones=st.just(UTC)),
       st.timedeltas(min_value=timedelta(0), max_value=RUN_ID_MAX_AHEAD),
       st.timedeltas(min_value=timedelta(0), max_value=timedelta(hours=1)),
       st.datetimes(min_value=datetime(1990, 1, 1), max_value=datetime(2199, 1, 1), timezones=st.just(UTC)))
def test_the_active_ceiling_is_above_every_run_a_start_can_create_meanwhile_and_every_active_run(
        now: datetime, ahead: timedelta, within: timedelta, newest: datetime) -> None:
    """Within ``within`` of the read, a start accepts IDs up to RUN_ID_MAX_AHEAD past its
    clock: all of them, and the newest active run, are at or below the ceiling."""
    later = now + within
    assert mint(later + ahead, "7fff-bfff-ffffffffffff") <= active_ceiling(now, None, within)
    newest_id = mint(newest)
    ceiling = active_ceiling(now, newest_id, within)
    assert newest_id <= ceiling and active_ceiling(now, None, within) <= ceiling
    assert ceiling in (month_bounds(month_of(newest_id))[1], active_ceiling(now, None, within))


def test_an_active_ceiling_from_an_id_that_is_not_a_uuidv7_is_at_least_that_id() -> None:
    odd = "ffffffff-0000-4000-8000-000000000000"
    assert active_ceiling(NOW, odd, timedelta(seconds=30)) == odd
    assert active_ceiling(NOW, "00000000-0000-4000-8000-000000000000", timedelta(seconds=30)) == active_ceiling(
        NOW, None, timedelta(seconds=30))


def test_an_active_floor_from_an_id_that_is_not_a_uuidv7_is_that_id() -> None:
    assert active_floor(NOW, "00000000-0000-4000-8000-000000000000") == "00000000-0000-4000-8000-000000000000"
    assert active_floor(NOW, "zzz") == active_floor(NOW, None)
    with pytest.raises(ValueError, match="timezone-aware"):
        active_floor(datetime(2026, 5, 17), None)
