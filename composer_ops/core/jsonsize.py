"""How big a JSON document is as the engine counts it, and the most it stores.

One limit for every JSON document a run holds: a client's input and payload and a
handler's output are checked against it before any write (engine/jsonvalues.py), and
a value the machine assembles itself (a MAP node's output, core/mapnode.py) when it is
assembled.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_BYTES", "json_size"]

#: The most bytes of JSON one stored document may hold (8 MiB).
MAX_BYTES = 8 * 1024 * 1024


def json_size(value: Any) -> int:
    """The size of ``value`` as stored: compact JSON in UTF-8 (a non-ASCII character
    counts its UTF-8 bytes, not a 6-byte escape)."""
    # allow_nan and default: a value read back from the database is measured, never refused.
    text = json.dumps(value, allow_nan=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return len(text.encode("utf-8", "backslashreplace"))
