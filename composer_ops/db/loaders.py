"""How values read from the database become Python values, where psycopg's own
loaders would refuse them.

PostgreSQL's ``timestamptz`` has ``'infinity'`` and ``'-infinity'``; Python's
``datetime`` has neither, and psycopg refuses to load them ("timestamp too large").
The engine never writes them, but a row edited by hand may hold one, and a reader
(``runs show``, ``check``, the reports) must still render it and flag it. Every
connection composer_ops opens (:class:`~composer_ops.db.errors.TranslatingConnection`)
loads them as ``datetime.max`` and ``datetime.min`` in UTC (psycopg's documented
way: a subclass of its loader, registered on the connection's adapters).
"""

from __future__ import annotations

from datetime import UTC, datetime

from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import AdaptersMap, Loader
from psycopg.pq import Format
from psycopg.types.datetime import TimestamptzBinaryLoader, TimestamptzLoader

#: What a ``timestamptz`` of ``'infinity'`` and ``'-infinity'`` loads as.
INFINITY = datetime.max.replace(tzinfo=UTC)
MINUS_INFINITY = datetime.min.replace(tzinfo=UTC)

# The binary form of a timestamp is microseconds since 2000-01-01 as an int64; the two
# infinities are its largest and smallest values.
_BINARY_INFINITY = (2**63 - 1).to_bytes(8, "big", signed=True)
_BINARY_MINUS_INFINITY = (-(2**63)).to_bytes(8, "big", signed=True)


class _Infinite(Loader):
    """A ``timestamptz`` loader that reads the infinities itself and hands every other
    value to the loader it replaces (``_inner``: psycopg's, in C where it is built), so
    an ordinary timestamp costs a comparison more, not a Python load."""

    _inner: type[Loader]

    def __init__(self, oid: int, context: AdaptContext | None = None):
        super().__init__(oid, context)
        self._load = self._inner(oid, context).load


class _InfiniteText(_Infinite):
    format = Format.TEXT

    def load(self, data: Buffer) -> datetime:
        if len(data) <= 9:              # 'infinity', '-infinity': no timestamp is as short
            raw = bytes(data)
            if raw == b"infinity":
                return INFINITY
            if raw == b"-infinity":
                return MINUS_INFINITY
        value: datetime = self._load(data)
        return value


class _InfiniteBinary(_Infinite):
    format = Format.BINARY

    def load(self, data: Buffer) -> datetime:
        if data[0] in (0x7F, 0x80):     # the int64's extremes; a real timestamp's top byte is near 0
            raw = bytes(data)
            if raw == _BINARY_INFINITY:
                return INFINITY
            if raw == _BINARY_MINUS_INFINITY:
                return MINUS_INFINITY
        value: datetime = self._load(data)
        return value


def register(context: AdaptContext) -> None:
    """Load infinite timestamps on ``context`` (a connection or cursor) and what it makes."""
    adapters: AdaptersMap = context.adapters
    oid = adapters.types["timestamptz"].oid
    for base, fallback in ((_InfiniteText, TimestamptzLoader), (_InfiniteBinary, TimestamptzBinaryLoader)):
        inner = adapters.get_loader(oid, base.format) or fallback
        if issubclass(inner, _Infinite):
            continue
        adapters.register_loader(oid, type(f"Infinite{inner.__name__}", (base,), {"_inner": inner}))


def is_infinite(value: datetime | None) -> bool:
    """True for a timestamp loaded from ``'infinity'`` or ``'-infinity'``."""
    return value is not None and (value == INFINITY or value == MINUS_INFINITY)
