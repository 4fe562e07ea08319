"""Identifiers: UUIDv7 text for runs, tasks and signals.

Run IDs minted by the engine take their timestamp from the *database* clock (one
clock: the run lands in the partition of the database's month). Task and signal IDs
use the process's monotonic UUIDv7 generator: within a run they are created under
the run lock, so their order is creation order.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta

import uuid6

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def uuid7_text() -> str:
    return str(uuid6.uuid7())


def new_run_id() -> str:
    """A run ID for ``Engine.start(run_id=...)``, minted by this process's clock: a
    canonical lowercase UUIDv7. A client that mints it before it calls (and stores it,
    to retry the same start) must start within an hour of minting, by the database
    clock (and this host's clock at most 5 minutes ahead of it); a start with a run ID
    already taken is a :class:`~composer_ops.errors.Conflict`."""
    return uuid7_text()


def uuid7_at(ts: datetime) -> str:
    """A fresh UUIDv7 whose 48-bit timestamp is ``ts`` (random low 74 bits)."""
    # Exact integer arithmetic: ts.timestamp() * 1000 is a float and can land on the
    # neighbouring millisecond (and so, at a month's edge, in the neighbouring partition).
    ms = (ts - _EPOCH) // timedelta(milliseconds=1)
    value = (ms << 80) | secrets.randbits(80)
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
