"""Who performs an operator action, as the client knows it (the audit row's actor)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Actor:
    """Who acts, as the client knows it: the command line (secrets removed) and the
    host it runs on. The database adds the roles and the address it sees. One Actor is
    one command: every audit row written for it shares its ``command_id``."""

    command: str | None = None
    host: str | None = None
    command_id: str = field(default_factory=lambda: uuid.uuid4().hex)
