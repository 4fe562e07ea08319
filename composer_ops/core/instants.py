"""The instants a workflow may name (a WAIT's ``until``): parsed and kept in range."""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["EARLIEST_INSTANT", "LATEST_INSTANT", "RANGE_TEXT", "instant_in_range", "parse_instant"]

#: The instants a WAIT may wake at: what the database stores and every session reads back.
#: PostgreSQL keeps 4713 BC to 294276 AD, but the driver reads a timestamp into a Python
#: datetime (years 1 to 9999) shown in the session's TimeZone (up to 16 hours off UTC),
#: so a day's margin is kept at each end.
EARLIEST_INSTANT = datetime(1, 1, 2, tzinfo=UTC)
LATEST_INSTANT = datetime(9999, 12, 30, 23, 59, 59, 999999, tzinfo=UTC)
RANGE_TEXT = "0001-01-02T00:00:00Z to 9999-12-30T23:59:59Z"


def instant_in_range(ts: datetime) -> bool:
    """Whether an aware instant is one the database stores and reads back (see
    ``EARLIEST_INSTANT``); an offset that pushes it past year 9999 is out of range."""
    try:
        return EARLIEST_INSTANT <= ts.astimezone(UTC) <= LATEST_INSTANT
    except (OverflowError, ValueError):
        return False


def parse_instant(text: str) -> datetime | None:
    """An aware ISO-8601 instant, or None (not an instant, or no offset)."""
    try:
        ts = datetime.fromisoformat(text)
    except ValueError:
        return None
    return ts if ts.tzinfo is not None and ts.utcoffset() is not None else None
