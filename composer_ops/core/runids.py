"""UUIDv7 run IDs: validation, embedded timestamps and partition bounds.

Run-scoped tables are range-partitioned by month on the run ID's text, which works
only because a canonical lowercase UUIDv7 sorts by its 48-bit millisecond
timestamp. A client-supplied run ID must therefore be exactly that shape, and
recent, or it would land in a partition that does not exist.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

from composer_ops.errors import Invalid

__all__ = [
    "RUN_ID_MAX_AGE",
    "RUN_ID_MAX_AHEAD",
    "RUN_START_SLACK",
    "add_months",
    "active_floor",
    "month_bounds",
    "month_label",
    "month_of",
    "month_start",
    "run_id_bound",
    "run_id_bound_ms",
    "uuid7_bound",
    "uuid7_timestamp",
    "validate_run_id",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_HEX = frozenset("0123456789abcdef")
_HYPHENS = (8, 13, 18, 23)
_EXAMPLE = "0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e8f"
#: Exactly what :func:`_check_uuid7` accepts: one match per event's run ID, and the
#: checks below only to say what is wrong with another.
_CANONICAL = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")

#: How far a client-supplied run ID's timestamp may lag or lead the database clock. A
#: month therefore still receives runs for RUN_ID_MAX_AGE after it ends (retention waits).
RUN_ID_MAX_AGE = timedelta(hours=1)
RUN_ID_MAX_AHEAD = timedelta(minutes=5)
#: How long a run's start transaction may have been open when the active floor is read
#: and still have its run above that floor (see :func:`active_floor`).
RUN_START_SLACK = timedelta(hours=1)


def _require_aware(ts: datetime, name: str) -> None:
    if ts.tzinfo is None or ts.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime, got {ts!r}")


def _epoch_ms(ts: datetime) -> int:
    # Exact integer arithmetic on the timedelta: ts.timestamp() is a float and can be
    # off by one millisecond, which would move a partition bound.
    delta = ts - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def _format_age(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else "", f"{secs}s" if secs else ""]
    return "".join(parts) or f"{delta.total_seconds():g}s"


def _iso(ts: datetime) -> str:
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _check_uuid7(run_id: object, name: str = "run id") -> str:
    """Return ``run_id`` if it is a canonical lowercase UUIDv7, else raise Invalid."""
    if isinstance(run_id, str) and _CANONICAL.fullmatch(run_id):
        return run_id
    if not isinstance(run_id, str):
        raise Invalid(f"{name} must be a string, got {type(run_id).__name__}")
    shape_ok = len(run_id) == 36 and all(
        (ch == "-") if i in _HYPHENS else (ch in _HEX or ch in "ABCDEF") for i, ch in enumerate(run_id)
    )
    if not shape_ok:
        raise Invalid(
            f"{name} {run_id!r} is not a canonical UUID: expected 36 characters, "
            f"hex digits with hyphens after the 8th, 12th, 16th and 20th, like {_EXAMPLE}"
        )
    if run_id != run_id.lower():
        raise Invalid(f"{name} {run_id!r} must be lowercase (try {run_id.lower()!r})")
    if run_id[14] != "7":
        raise Invalid(f"{name} {run_id!r} is a version {run_id[14]} UUID, not a UUIDv7")
    if run_id[19] not in "89ab":
        raise Invalid(
            f"{name} {run_id!r} has variant nibble {run_id[19]!r}; "
            "a UUIDv7 needs the RFC 9562 variant (bits 10xx: 8, 9, a or b)"
        )
    raise Invalid(f"{name} {run_id!r} is not a canonical UUIDv7, like {_EXAMPLE}")


def uuid7_timestamp(run_id: str) -> datetime:
    """The UTC instant (millisecond precision) embedded in a canonical UUIDv7.

    Raises ``Invalid`` when ``run_id`` is not a canonical lowercase UUIDv7.
    """
    _check_uuid7(run_id)
    ms = int(run_id[0:8] + run_id[9:13], 16)
    return _EPOCH + timedelta(milliseconds=ms)


def validate_run_id(
    value: object,
    now: datetime | None = None,
    *,
    normalise: bool = False,
    name: str = "run id",
    max_age: timedelta = RUN_ID_MAX_AGE,
    max_ahead: timedelta = RUN_ID_MAX_AHEAD,
) -> str:
    """The check of a run ID: its canonical text, or ``Invalid`` naming ``name`` and
    what is wrong.

    A run ID is a canonical lowercase UUIDv7 with the RFC 9562 variant; that text is
    the partition key, so no other spelling names the same run. ``normalise=True``
    first accepts what a person may paste (any case, surrounding spaces, braces, a
    ``urn:uuid:`` prefix) and returns the canonical text: for looking a run up, never
    for naming a new one. With ``now`` (the database clock), an ID minted more than
    ``max_age`` before it or more than ``max_ahead`` after it is refused too: what a
    client-supplied ID of a new run must meet.
    """
    if normalise:
        if not isinstance(value, str):
            raise Invalid(f"{name} must be a UUID string, got {type(value).__name__} {value!r}")
        try:
            value = str(uuid.UUID(value.strip()))
        except ValueError:
            raise Invalid(f"{name} {value!r} is not a UUID: expected 32 hex digits, with hyphens after the 8th, "
                          f"12th, 16th and 20th, like {_EXAMPLE}") from None
    run_id = _check_uuid7(value, name)
    if now is None:
        return run_id
    _require_aware(now, "now")
    minted = uuid7_timestamp(run_id)
    if minted < now - max_age:
        raise Invalid(
            f"{name} {run_id} was minted at {_iso(minted)}, more than {_format_age(max_age)} "
            f"before the database clock {_iso(now)}"
        )
    if minted > now + max_ahead:
        raise Invalid(
            f"{name} {run_id} was minted at {_iso(minted)}, more than {_format_age(max_ahead)} "
            f"after the database clock {_iso(now)}"
        )
    return run_id


def month_of(run_id: str) -> str:
    """The ``YYYYMM`` (UTC) of the partition a run ID belongs to."""
    ts = uuid7_timestamp(run_id)
    return f"{ts.year:04d}{ts.month:02d}"


def uuid7_bound(ts: datetime) -> str:
    """The smallest UUIDv7 text whose timestamp is at or after ``ts``.

    Byte-identical to the SQL function ``composer_uuid7_bound``: it is the partition
    boundary for runs created from ``ts`` onwards.
    """
    _require_aware(ts, "ts")
    ms = _epoch_ms(ts)
    # to_hex() of a negative bigint prints its two's complement and lpad() truncates
    # to 12 characters; mirror both so the result matches SQL for every input.
    h = format(ms & 0xFFFF_FFFF_FFFF_FFFF, "x") if ms < 0 else format(ms, "x")
    h = h.rjust(12, "0")[:12]
    return f"{h[:8]}-{h[8:12]}-0000-0000-000000000000"


#: The first millisecond a UUIDv7's 48-bit timestamp cannot hold (10889-08-02 UTC).
UUID7_MS_LIMIT = 1 << 48
#: Text at or below every UUIDv7 (the bound of the epoch), and text above every UUIDv7
#: (whose 15th character is the version, 7): run IDs compare as bytes (COLLATE "C").
_BELOW_ALL = "00000000-0000-0000-0000-000000000000"
_ABOVE_ALL = "ffffffff-ffff-ffff-ffff-ffffffffffff"


def run_id_bound_ms(ms: int) -> str:
    """The run-ID bound of millisecond ``ms`` of the Unix epoch, for selecting runs: a
    run ID is at or above it exactly when the run was created at or after ``ms``. An
    instant before the epoch gives text below every run ID (``id >= b`` selects every
    run, ``id < b`` none); one past the 48-bit limit, text above every run ID (the
    other way round). :func:`uuid7_bound` instead mirrors SQL, whose bound of such an
    instant wraps around and would select the opposite runs."""
    if ms < 0:
        return _BELOW_ALL
    if ms >= UUID7_MS_LIMIT:
        return _ABOVE_ALL
    h = format(ms, "012x")
    return f"{h[:8]}-{h[8:12]}-0000-0000-000000000000"


def run_id_bound(ts: datetime) -> str:
    """:func:`run_id_bound_ms` of the instant ``ts`` (aware)."""
    _require_aware(ts, "ts")
    return run_id_bound_ms(_epoch_ms(ts))


def month_start(month: str) -> datetime:
    """The UTC instant a ``YYYYMM`` month starts at; raises ``Invalid`` on bad text."""
    if len(month) != 6 or not month.isascii() or not month.isdigit():
        raise Invalid(f"month {month!r} is not YYYYMM")
    year, mon = int(month[:4]), int(month[4:])
    if not 1 <= mon <= 12 or year < 1:
        raise Invalid(f"month {month!r} is not YYYYMM")
    return datetime(year, mon, 1, tzinfo=UTC)


def month_label(value: datetime) -> str:
    """The ``YYYYMM`` (partition suffix) of the UTC month containing ``value``."""
    _require_aware(value, "value")
    return value.astimezone(UTC).strftime("%Y%m")


def add_months(month: str, n: int) -> str:
    """``add_months("202612", 2) == "202702"``; ``n`` may be negative (partition
    suffix arithmetic)."""
    start = month_start(month)
    index = start.year * 12 + start.month - 1 + n
    return f"{index // 12:04d}{index % 12 + 1:02d}"


def month_bounds(month: str) -> tuple[str, str]:
    """The ``(from, to)`` run-ID bounds of a month's partition, as the SQL creates them."""
    return uuid7_bound(month_start(month)), uuid7_bound(month_start(add_months(month, 1)))


def active_ceiling(now: datetime, newest_active: str | None, within: timedelta) -> str:
    """The run ID above which no run needs the coordinator's timers or lease sweeper for
    the next ``within`` after ``now`` (the database clock), with ``newest_active`` the
    greatest run ID that has an active task (None: none has): the end of the later of
    two months, that of ``newest_active`` and that of ``now + RUN_ID_MAX_AHEAD +
    within`` (the newest ID a start may accept meanwhile). An ID compared ``<=`` it. A
    ``newest_active`` that is not a UUIDv7 (written by hand) bounds the ceiling itself;
    such a run made after the read is seen from the next read, as below the floor."""
    _require_aware(now, "now")
    ceiling = month_bounds(month_label(now + RUN_ID_MAX_AHEAD + within))[1]
    if newest_active is None:
        return ceiling
    try:
        return max(ceiling, month_bounds(month_of(newest_active))[1])
    except Invalid:
        return max(ceiling, newest_active)


def active_floor(now: datetime, oldest_active: str | None) -> str:
    """The run ID below which no run needs the coordinator's timers or lease sweeper,
    as read at the database clock ``now`` with ``oldest_active`` the least run ID that
    has an active task (None: none has): the first of the earlier of two months, that
    of ``oldest_active`` and that of ``now - RUN_ID_MAX_AGE - RUN_START_SLACK``.

    The second term covers runs whose start has not committed yet: a start checks its
    client-supplied ID against the clock of its own transaction, which may have begun
    before ``now``, so an ID up to ``RUN_ID_MAX_AGE`` older than that start is accepted.
    A start transaction open for less than ``RUN_START_SLACK`` when the floor is read
    therefore names a run above it; one open longer is seen from the next read (its
    task is active by then). An ``oldest_active`` that is not a UUIDv7 (written by hand)
    bounds the floor itself."""
    _require_aware(now, "now")
    floor = month_bounds(month_label(now - RUN_ID_MAX_AGE - RUN_START_SLACK))[0]
    if oldest_active is None:
        return floor
    try:
        return min(floor, month_bounds(month_of(oldest_active))[0])
    except Invalid:
        return min(floor, oldest_active)
