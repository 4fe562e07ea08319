"""A retention or selection cut-off as the operator writes it, parsed without a clock.

An ISO date (midnight UTC), an ISO instant (UTC when it has no offset), or an age like
``90d``, ``2w``, ``6 months``, ``1y``, ``36h``, ``10min``; an age is counted back from the database
clock when it is resolved (``repo.retention.resolve``), in UTC calendar arithmetic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime

from composer_ops.errors import Invalid

__all__ = ["Cutoff", "parse_cutoff"]

_RELATIVE = re.compile(r"^\s*(\d{1,6})\s*([a-z]+)\s*$")
_UNITS = {
    "min": "minutes", "mins": "minutes", "minute": "minutes", "minutes": "minutes",
    "h": "hours", "hour": "hours", "hours": "hours",
    "d": "days", "day": "days", "days": "days",
    "w": "weeks", "week": "weeks", "weeks": "weeks",
    "mo": "months", "mon": "months", "month": "months", "months": "months",
    "y": "years", "year": "years", "years": "years",
}


@dataclass(frozen=True, kw_only=True)
class Cutoff:
    """A cut-off: an absolute ``instant``, or an age (``amount`` of ``unit``, a keyword of
    ``repo.partitions.age_before_now``) counted back from the database clock."""

    text: str
    instant: datetime | None = None
    amount: int = 0
    unit: str = ""


def parse_cutoff(text: str) -> Cutoff:
    """Parse a --older-than / cutoff value; :class:`Invalid` says what is accepted."""
    if not isinstance(text, str) or not text.strip():
        raise Invalid(f"cut-off {text!r} is empty: give an ISO date (2025-01-31), an ISO instant "
                      "(2025-01-31T12:00:00Z) or an age (90d, 2w, 6 months, 1y, 36h)")
    raw = text.strip()
    rel = _RELATIVE.match(raw.lower())
    if rel:
        unit = _UNITS.get(rel.group(2))
        if unit is None:
            raise Invalid(f"cut-off {text!r}: unknown unit {rel.group(2)!r} (use min, h, d, w, mo/months or y)")
        return Cutoff(text=raw, amount=int(rel.group(1)), unit=unit)
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", raw):
            day = date.fromisoformat(raw)
            return Cutoff(text=raw, instant=datetime(day.year, day.month, day.day, tzinfo=UTC))
        instant = datetime.fromisoformat(raw.replace("z", "Z"))
    except ValueError as exc:
        raise Invalid(f"cut-off {text!r} is not an ISO date/instant or an age like 90d or 6 months ({exc})") from None
    if instant.tzinfo is None:
        instant = instant.replace(tzinfo=UTC)
    return Cutoff(text=raw, instant=instant.astimezone(UTC))
