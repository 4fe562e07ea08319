"""Which runs an operator means: the selector of ``runs list``, ``runs cancel`` and ``runs retry``.

A :class:`RunFilter` names a workflow, statuses, a creation window and conditions on the
run's input. The window becomes run-ID bounds (a UUIDv7 sorts by its creation instant),
so PostgreSQL skips the months outside it; the ``--where`` conditions
(:func:`parse_where`: ``input.customer=42 and input.tier=gold``, values as JSON, a bare
word a string) become one JSON document the input must contain (``@>``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from composer_ops.core.model import RunStatus
from composer_ops.core.runids import run_id_bound
from composer_ops.errors import Invalid

__all__ = ["RunFilter", "parse_statuses", "parse_where"]

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_BARE = re.compile(r"[^\s\"'=]+")
_AND = re.compile(r"and\b", re.IGNORECASE)
_EXAMPLE = "input.customer=42"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_MAX_EXPR = 4096


@dataclass(frozen=True, kw_only=True)
class RunFilter:
    """A selection of runs. ``since`` / ``until`` are instants (UTC, aware): runs
    created at or after ``since`` and before ``until``. ``contains`` is the JSON
    document the run's input must contain (None: any input)."""

    workflow_id: str | None = None
    statuses: tuple[RunStatus, ...] = ()
    since: datetime | None = None
    until: datetime | None = None
    contains: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and (value.tzinfo is None or value.utcoffset() is None):
                raise Invalid(f"{name} {value.isoformat()} has no time zone; pass an aware datetime (UTC)")
        if self.since is not None and self.until is not None and self.until <= self.since:
            raise Invalid(f"the window is empty: until {self.until.isoformat()} is not after "
                          f"since {self.since.isoformat()}")

    @property
    def id_from(self) -> str | None:
        """The smallest run ID created at ``since`` (inclusive bound), or None. Clamped:
        a ``since`` before 1970 selects every run (:func:`~composer_ops.core.runids.run_id_bound`)."""
        return run_id_bound(self.since) if self.since is not None else None

    @property
    def id_to(self) -> str | None:
        """The smallest run ID created at ``until`` (exclusive bound), or None. Clamped:
        an ``until`` before 1970 selects no run."""
        return run_id_bound(self.until) if self.until is not None else None

    @property
    def selective(self) -> bool:
        """Whether anything narrows the selection beyond statuses."""
        return any(v is not None for v in (self.workflow_id, self.since, self.until, self.contains))


def parse_statuses(values: Iterable[str] | str | None) -> tuple[RunStatus, ...]:
    """Run statuses from ``FAILED``, ``failed,cancelled`` or a list of those."""
    if values is None:
        return ()
    items = [values] if isinstance(values, str) else list(values)
    out: list[RunStatus] = []
    for item in items:
        for part in str(item).split(","):
            name = part.strip().upper()
            if not name:
                continue
            try:
                status = RunStatus(name)
            except ValueError:
                known = ", ".join(s.value for s in RunStatus)
                raise Invalid(f"unknown run status {part.strip()!r} (one of {known})") from None
            if status not in out:
                out.append(status)
    return tuple(out)


def parse_where(text: str, *, option: str = "--where") -> dict[str, Any]:
    """The JSON document an input must contain for ``text`` to hold; :class:`Invalid`
    naming the column of the first thing that is wrong."""
    if not isinstance(text, str):
        raise Invalid(f"{option} must be text like {_EXAMPLE}, got {type(text).__name__}")
    if len(text) > _MAX_EXPR:
        raise Invalid(f"{option} is {len(text)} characters long; at most {_MAX_EXPR}")
    if not text.strip():
        raise Invalid(f"{option} is empty: give conditions like {_EXAMPLE}")
    parser = _Parser(text, option)
    document: dict[str, Any] = {}
    while True:
        start = parser.skip_space()
        path = parser.path()
        parser.expect("=")
        value = parser.value()
        _merge(document, path, value, parser.fail_at(start, "repeats a condition on input.{}".format(".".join(path))))
        parser.skip_space()
        if parser.at_end():
            return document
        parser.conjunction()


def _merge(document: dict[str, Any], path: list[str], value: Any, conflict: Invalid) -> None:
    """Put ``value`` at ``path`` in ``document``; two conditions on one path (or on a
    path and its parent) cannot both be containment of one value."""
    node = document
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise conflict
        node = child
    if path[-1] in node:
        raise conflict
    node[path[-1]] = value


class _Parser:
    def __init__(self, text: str, option: str) -> None:
        self.text, self.option, self.pos = text, option, 0

    def fail_at(self, pos: int, what: str) -> Invalid:
        shown = self.text if len(self.text) <= 80 else self.text[:77] + "..."
        shown = shown.encode("unicode_escape").decode("ascii")
        return Invalid(f"{self.option} {shown!r}: at column {pos + 1}: {what} (e.g. {_EXAMPLE})")

    def fail(self, what: str) -> Invalid:
        return self.fail_at(self.pos, what)

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def skip_space(self) -> int:
        while not self.at_end() and self.text[self.pos].isspace():
            self.pos += 1
        return self.pos

    def expect(self, char: str) -> None:
        self.skip_space()
        if self.text.startswith(char, self.pos):
            self.pos += len(char)
            return
        found = repr(self.text[self.pos]) if not self.at_end() else "the end"
        raise self.fail(f"expected {char!r}, found {found}")

    def key(self) -> str:
        if self.text.startswith('"', self.pos):
            try:
                value, end = json.JSONDecoder().raw_decode(self.text, self.pos)
            except json.JSONDecodeError:
                raise self.fail("a quoted key is not closed") from None
            if not isinstance(value, str) or not value:
                raise self.fail("a quoted key must be a non-empty string")
            self.pos = end
            return value
        match = _KEY.match(self.text, self.pos)
        if match is None:
            raise self.fail("expected a key (letters, digits, _ or -, or a \"quoted key\")")
        self.pos = match.end()
        return match.group()

    def path(self) -> list[str]:
        start = self.pos
        root = self.key()
        if root != "input":
            raise self.fail_at(start, f"a condition is on the run's input, so its path starts with input., "
                                      f"not {root!r}")
        keys: list[str] = []
        while self.text.startswith(".", self.pos):
            self.pos += 1
            keys.append(self.key())
        if not keys:
            raise self.fail("expected .KEY after input")
        return keys

    def value(self) -> Any:
        self.skip_space()
        if self.at_end():
            raise self.fail("expected a value after '='")
        try:
            value, end = _DECODER.raw_decode(self.text, self.pos)
        except (json.JSONDecodeError, RecursionError, ValueError):
            value, end = None, -1
        if end > 0 and (end >= len(self.text) or self.text[end].isspace()):
            self.pos = end
            return value
        if self.text[self.pos] == "'":
            raise self.fail("strings are quoted with double quotes (\"gold\"), or written bare (gold)")
        if self.text[self.pos] in "\"[{":
            raise self.fail("the value is not valid JSON")
        match = _BARE.match(self.text, self.pos)
        if match is None:
            raise self.fail("expected a value after '='")
        self.pos = match.end()
        return match.group()

    def conjunction(self) -> None:
        match = _AND.match(self.text, self.pos)
        if match is None:
            raise self.fail("expected 'and' between two conditions")
        self.pos = match.end()
        spaced = self.skip_space() > match.end()
        if self.at_end():
            raise self.fail("expected a condition after 'and'")
        if not spaced:
            raise self.fail("expected a space after 'and'")
