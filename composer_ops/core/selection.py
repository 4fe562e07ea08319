"""A selection of runs as an operator gives it, checked whole before anything is read.

:func:`selection` checks a workflow id, statuses, a creation window and ``--where``
(:class:`Invalid` names what is wrong); the window may hold ages (``7d``) that only the
database clock turns into instants, so a :class:`Selection` becomes a
:class:`~composer_ops.core.filters.RunFilter` once the caller resolves them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from composer_ops.core.cutoff import Cutoff, parse_cutoff
from composer_ops.core.filters import RunFilter, parse_statuses, parse_where
from composer_ops.core.model import RunStatus
from composer_ops.core.spec import ID_PATTERN
from composer_ops.errors import Invalid

__all__ = ["MAX_LIMIT", "Selection", "When", "check_limit", "parse_when", "selection"]

#: The most runs one ``runs list`` returns.
MAX_LIMIT = 10_000

When = datetime | str | None


@dataclass(frozen=True, kw_only=True)
class Selection:
    """A checked selection whose window may still hold ages to count back from the
    database clock (:meth:`resolve`)."""

    workflow_id: str | None
    statuses: tuple[RunStatus, ...]
    since: datetime | Cutoff | None
    until: datetime | Cutoff | None
    contains: dict[str, Any] | None

    def resolve(self, instant: Callable[[Cutoff], datetime]) -> RunFilter:
        """The filter, each age of the window made an instant by ``instant``
        (``repo.retention.resolve`` on the reading connection)."""
        def at(value: datetime | Cutoff | None) -> datetime | None:
            return value if value is None or isinstance(value, datetime) else instant(value)

        return RunFilter(workflow_id=self.workflow_id, statuses=self.statuses, since=at(self.since),
                         until=at(self.until), contains=self.contains)


def _when(value: When, option: str) -> datetime | Cutoff | None:
    return None if value is None or value == "" else parse_when(value, option)


def parse_when(value: datetime | str, option: str) -> datetime | Cutoff:
    """An instant a selection (or a backfill) is bounded by: an aware datetime, or text
    :func:`parse_cutoff` reads (an ISO date or instant, or an age counted back from the
    database clock); anything else is Invalid naming ``option``."""
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise Invalid(f"{option} {value.isoformat()} has no time zone; pass an aware datetime (UTC)")
        return value.astimezone(UTC)
    if not isinstance(value, str):
        raise Invalid(f"{option} must be a date, an instant or an age like 7d, got {type(value).__name__}")
    try:
        return parse_cutoff(value)
    except Invalid:
        raise Invalid(f"{option} {value!r} is not an ISO date (2025-01-31), an ISO instant "
                      "(2025-01-31T12:00:00Z) or an age (10min, 36h, 7d, 2w, 3 months, 1y)") from None


def selection(*, workflow: str | None = None, status: str | Sequence[str] | None = None, since: When = None,
              until: When = None, where: str | Mapping[str, Any] | None = None) -> Selection:
    """Check a selection of runs: a workflow id, statuses (``FAILED`` or
    ``failed,cancelled``), a window (``since`` inclusive, ``until`` exclusive: each an
    ISO date, an ISO instant or an age like ``7d`` counted back from the database
    clock), and ``where`` (the ``--where`` language of :mod:`composer_ops.core.filters`,
    or the JSON object the input must contain). :class:`Invalid` names what is wrong."""
    if workflow is not None and (not isinstance(workflow, str) or not ID_PATTERN.fullmatch(workflow)):
        raise Invalid(f"workflow id {workflow!r} is not a workflow id (1 to 128 of A-Z a-z 0-9 _ . -)")
    if where is None or where == "":
        contains = None
    elif isinstance(where, str):
        contains = parse_where(where)
    elif isinstance(where, Mapping):
        contains = dict(where)
    else:
        raise Invalid(f"where must be text like input.customer=42 or a JSON object, got {type(where).__name__}")
    return Selection(workflow_id=workflow, statuses=parse_statuses(status), since=_when(since, "since"),
                     until=_when(until, "until"), contains=contains)


def check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise Invalid(f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")
