"""Who performs an operator action, as the client knows it (the audit row's actor)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Actor:
    """Who acts, as the client knows it: the command line (secrets removed) and the
    host it runs on. The database adds the roles and the address it sees."""

    command: str | None = None
    host: str | None = None
