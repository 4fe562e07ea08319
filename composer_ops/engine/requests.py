"""A request: one call of the engine's API, kept across the retries of its transaction.

Its ``id`` is minted once per call and written into every run-history row the call
writes, in the same transaction as the change. When a transaction's COMMIT is
acknowledged, nothing more is needed; when the acknowledgement is lost (the
connection dies after the server committed), the whole transaction is retried, and
the retry, and only the retry, first looks for rows of its request: if the lost
attempt committed they are there, and the retry returns the original outcome instead
of applying the change a second time. A signal sent with the caller's idempotency key
uses ``key:<key>`` as its request and looks on every call, first ones included, so
that two calls with one key resolve at most one node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer_ops.engine.ids import uuid7_text

__all__ = ["Request", "key_request"]

KEY_PREFIX = "key:"


@dataclass
class Request:
    """One API call; ``look_first`` also on its first attempt (a caller's key).
    ``operator``: set on an operator action (the audit row's action, command line and
    host), copied into the history row of the event it applies, whose ``request`` is
    also the audit row's."""

    id: str = field(default_factory=uuid7_text)
    look_first: bool = False
    tries: int = 0
    operator: dict[str, Any] | None = None

    def attempt(self) -> bool:
        """Begin an attempt of the call's transaction. True when it must first look
        for rows its request already wrote (a retry, or a caller's key)."""
        self.tries += 1
        return self.look_first or self.tries > 1


def key_request(key: str) -> Request:
    """The request of a signal sent with the caller's idempotency key."""
    return Request(id=KEY_PREFIX + key, look_first=True)
