"""A selection's creation window as run-ID bounds, for every instant: before 1970, in
the UUIDv7 range, and past its 48-bit millisecond limit (year 10889). A run is
selected by ``id >= bound(since)`` exactly when it was created at or after ``since``,
and by ``id < bound(until)`` exactly when it was created before ``until``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from hypothesis import example, given
from hypothesis import strategies as st

from composer_ops.core.filters import RunFilter
from composer_ops.core.runids import UUID7_MS_LIMIT, run_id_bound, run_id_bound_ms, uuid7_bound, uuid7_timestamp

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Every millisecond a datetime can hold (years 1 to 9999), and far past the UUIDv7 limit.
ANY_MS = st.integers(min_value=-62_135_596_800_000, max_value=UUID7_MS_LIMIT * 4)
RUN_MS = st.integers(min_value=0, max_value=UUID7_MS_LIMIT - 1)
#: Runs a datetime can say the creation instant of (up to the end of 9999).
DATED_RUN_MS = st.integers(min_value=0, max_value=253_402_300_799_999)
INSTANTS = st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59),
                        timezones=st.just(UTC))
#: The random tail of a run ID: version 7, RFC 9562 variant, any random bits.
TAILS = st.tuples(st.integers(0, 0xFFF), st.sampled_from("89ab"), st.integers(0, 0xFFF), st.integers(0, 2**48 - 1))


def run_id(ms: int, tail: tuple[int, str, int, int]) -> str:
    rand_a, variant, rand_b, rand_c = tail
    h = f"{ms:012x}"
    return f"{h[:8]}-{h[8:]}-7{rand_a:03x}-{variant}{rand_b:03x}-{rand_c:012x}"


def ms_of(ts: datetime) -> int:
    delta = ts - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


@given(created=RUN_MS, tail=TAILS, at=ANY_MS)
@example(created=0, tail=(0, "8", 0, 0), at=-1)
@example(created=0, tail=(0, "8", 0, 0), at=0)
@example(created=UUID7_MS_LIMIT - 1, tail=(0xFFF, "b", 0xFFF, 2**48 - 1), at=UUID7_MS_LIMIT - 1)
@example(created=UUID7_MS_LIMIT - 1, tail=(0xFFF, "b", 0xFFF, 2**48 - 1), at=UUID7_MS_LIMIT)
@example(created=5, tail=(0, "8", 0, 0), at=-(2**63))
def test_a_bound_selects_exactly_the_runs_on_its_side(created: int, tail: tuple[int, str, int, int],
                                                      at: int) -> None:
    rid = run_id(created, tail)
    bound = run_id_bound_ms(at)
    assert (rid >= bound) == (created >= at)        # since: inclusive
    assert (rid < bound) == (created < at)          # until: exclusive


@given(a=ANY_MS, b=ANY_MS)
def test_bounds_are_monotone_in_the_instant(a: int, b: int) -> None:
    if a <= b:
        assert run_id_bound_ms(a) <= run_id_bound_ms(b)


@given(since=st.none() | INSTANTS, until=st.none() | INSTANTS, created=DATED_RUN_MS, tail=TAILS)
@example(since=datetime(1926, 12, 2, tzinfo=UTC), until=None, created=1_790_000_000_000, tail=(1, "9", 2, 3))
@example(since=None, until=datetime(1969, 12, 31, tzinfo=UTC), created=1_790_000_000_000, tail=(1, "9", 2, 3))
@example(since=datetime(1969, 12, 31, tzinfo=UTC), until=datetime(1970, 1, 2, tzinfo=UTC), created=0,
         tail=(0, "8", 0, 0))
def test_every_selection_window_selects_the_runs_created_in_it(since: datetime | None, until: datetime | None,
                                                               created: int, tail: tuple[int, str, int, int]) -> None:
    if since is not None and until is not None and until <= since:
        return
    window = RunFilter(since=since, until=until)
    rid = run_id(created, tail)
    at = uuid7_timestamp(rid)
    selected = ((window.id_from is None or rid >= window.id_from)
                and (window.id_to is None or rid < window.id_to))
    assert selected == ((since is None or at >= since) and (until is None or at < until))


@given(ts=INSTANTS, offset=st.integers(min_value=-14 * 60, max_value=14 * 60))
def test_the_bound_of_an_instant_is_that_of_its_millisecond_in_any_zone(ts: datetime, offset: int) -> None:
    zone = UTC if offset == 0 else timezone(timedelta(minutes=offset))
    try:
        shown = ts.astimezone(zone)
    except OverflowError:
        return
    assert run_id_bound(shown) == run_id_bound_ms(ms_of(ts))


def test_the_clamps() -> None:
    assert run_id_bound(datetime(1969, 12, 31, tzinfo=UTC)) == "00000000-0000-0000-0000-000000000000"
    assert run_id_bound(datetime(1, 1, 1, tzinfo=UTC)) == "00000000-0000-0000-0000-000000000000"
    assert run_id_bound(EPOCH) == "00000000-0000-0000-0000-000000000000"
    assert run_id_bound(datetime(2026, 5, 17, tzinfo=UTC)) == uuid7_bound(datetime(2026, 5, 17, tzinfo=UTC))
    assert run_id_bound_ms(UUID7_MS_LIMIT) == "ffffffff-ffff-ffff-ffff-ffffffffffff"
