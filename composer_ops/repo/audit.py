"""The operator audit (``operator_audit``): one row per operator action, written by the
action's own transaction.

The database supplies who and from where (``session_user``, ``current_user``, the
client address it sees) and the time; the caller supplies the :class:`Actor` (command
line, host), what was acted on and the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from composer_ops.repo._base import Conn, fetch_all, jsonb
from composer_ops.repo.rows import AuditRow


@dataclass(frozen=True, kw_only=True)
class Actor:
    """Who acts, as the client knows it: the command line (secrets removed) and the
    host it runs on. The database adds the roles and the address it sees."""

    command: str | None = None
    host: str | None = None


def can_record(conn: Conn) -> tuple[bool, str]:
    """Whether the session's role may write audit rows (every operator action writes
    one, so a role that cannot is read-only for operator actions), and its name."""
    row = conn.execute("SELECT has_table_privilege('operator_audit', 'INSERT'), current_user::text").fetchone()
    assert row is not None
    return bool(row[0]), str(row[1])


def operator_note(action: str, actor: Actor | None) -> dict[str, Any]:
    """What a run's history says of the operator action ``action`` that changed it
    (the audit row, whose ``request`` the history row shares, has the rest)."""
    note: dict[str, Any] = {"action": action}
    if actor is not None and actor.command:
        note["command"] = actor.command
    if actor is not None and actor.host:
        note["host"] = actor.host
    return note


_COLUMNS = """id, at, action, target, counts, detail, command, client_host, client_addr, login_role, db_role,
              request"""


def record(conn: Conn, action: str, *, actor: Actor | None, target: str | None, counts: dict[str, Any],
           detail: Any = None, request: str | None = None) -> AuditRow:
    """Append one audit row in the caller's transaction and return it."""
    rows = fetch_all(conn, AuditRow, f"""
        INSERT INTO operator_audit (action, target, counts, detail, command, client_host, request)
        VALUES (%s, %s, %s, %s, %s, %s, %s)
        RETURNING {_COLUMNS}""",
        (action, target, jsonb(counts), jsonb(detail), actor.command if actor else None,
         actor.host if actor else None, request))
    return rows[0]


def of_request(conn: Conn, request: str) -> list[AuditRow]:
    """The rows ``request`` wrote (none unless a transaction of it committed)."""
    return fetch_all(conn, AuditRow, f"SELECT {_COLUMNS} FROM operator_audit WHERE request = %s ORDER BY id",
                     (request,))


def recent(conn: Conn, *, since: datetime | None = None, limit: int = 200,
           actions: list[str] | None = None) -> list[AuditRow]:
    """The newest rows first, at most ``limit``, optionally from ``since`` on and of
    the given actions only."""
    return fetch_all(conn, AuditRow, f"""
        SELECT {_COLUMNS} FROM operator_audit
         WHERE (%(since)s::timestamptz IS NULL OR at >= %(since)s)
           AND (%(actions)s::text[] IS NULL OR action = ANY(%(actions)s))
         ORDER BY at DESC, id DESC
         LIMIT %(limit)s""", {"since": since, "actions": actions, "limit": limit})
