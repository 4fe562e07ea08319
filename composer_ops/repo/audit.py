"""The operator audit (``operator_audit``): one row per operator action, written by the
action's own transaction.

The database supplies who and from where (``session_user``, ``current_user``, the
client address it sees) and the time; the caller supplies the
:class:`~composer_ops.core.actor.Actor` (command line, host), what was acted on and
the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from composer_ops.core.actor import Actor
from composer_ops.db import roles
from composer_ops.errors import PermissionDenied
from composer_ops.repo._base import Conn, fetch_all, jsonb
from composer_ops.repo.rows import AuditRow

#: Every action an audit row names (``composer-ops audit list --action``).
ACTIONS = ("partitions archive", "partitions drop", "partitions detach", "partitions restore", "partitions ensure",
           "runs cancel", "runs retry", "runs delete", "schedules create", "schedules pause", "schedules resume",
           "schedules delete", "schedules trigger", "schedules backfill", "queues pause", "queues resume",
           "queues set-limit", "lease sweep")

# Actor is also imported from here by engine modules (admin, archive, retention, retire).
__all__ = ["ACTIONS", "ESTIMATED_ROWS", "Actor", "commands", "of_request", "operator_note", "recent", "record",
           "require_record"]

#: The counts' key of rows that are the catalog's estimate, not a count (``reltuples``,
#: else the live-tuple statistic: 0 for a month never analysed since the statistics were
#: reset): what ``partitions drop`` and ``detach`` record; an archive's rows are ``rows``.
ESTIMATED_ROWS = "rows_estimated"


def can_record(conn: Conn) -> tuple[bool, str]:
    """Whether the session's role may write audit rows (every operator action writes
    one, so a role that cannot is read-only for operator actions), and its name."""
    row = conn.execute("SELECT has_any_column_privilege('operator_audit', 'INSERT'), current_user::text").fetchone()
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
              request, command_id"""


def record(conn: Conn, action: str, *, actor: Actor | None, target: str | None, counts: dict[str, Any],
           detail: Any = None, request: str | None = None) -> AuditRow:
    """Append one audit row in the caller's transaction and return it. ``action`` is one
    of :data:`ACTIONS`, which ``audit list --action`` accepts (else ValueError: a bug)."""
    if action not in ACTIONS:
        raise ValueError(f"audit action {action!r} is not one of ACTIONS (composer_ops/repo/audit.py)")
    rows = fetch_all(conn, AuditRow, f"""
        INSERT INTO operator_audit (action, target, counts, detail, command, client_host, request, command_id)
        VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
        RETURNING {_COLUMNS}""",
        (action, target, jsonb(counts), jsonb(detail), actor.command if actor else None,
         actor.host if actor else None, request, actor.command_id if actor else None))
    return rows[0]


#: The operator actions only the schema's owner may take: they create, drop or detach
#: partitions, or read ``schema_migrations`` (docs/security.md).
OWNER_ACTIONS = frozenset({"partitions archive", "partitions drop", "partitions detach", "partitions restore"})


def require_record(conn: Conn, action: str) -> None:
    """Refuse (:class:`PermissionDenied`) an ``action`` whose audit row the session's role
    could not write, or, for :data:`OWNER_ACTIONS`, a role that is not the schema's owner
    (nor a superuser), before the action does anything it cannot take back (files it
    writes outside the database are not rolled back with the transaction)."""
    if action in OWNER_ACTIONS:
        roles.require_owner(conn, action, "it reads schema_migrations and creates, drops or detaches partitions")
        return
    row = conn.execute("SELECT current_user, has_any_column_privilege('operator_audit', 'INSERT')").fetchone()
    if row is not None and not row[1]:
        raise PermissionDenied(f"{action}: role {row[0]} may not write the operator audit (operator_audit); "
                               "run it as the operator role (the owner or composer_ops_engine)")


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


#: What a row's command is: the id the command wrote (sql/V001), else its request without
#: the ``:chunk``/``:month`` suffix the engine adds per transaction, else the row alone.
_COMMAND_KEY = "COALESCE(command_id, split_part(request, ':', 1), 'row ' || id)"


@dataclass(frozen=True, kw_only=True)
class AuditCommand:
    """One command's audit rows, oldest first (a bulk cancel writes one per chunk, a
    retention drop one per month), and what they add up to."""

    rows: list[AuditRow]

    @property
    def first(self) -> AuditRow:
        return self.rows[0]

    @property
    def last(self) -> AuditRow:
        return self.rows[-1]

    @property
    def actions(self) -> list[str]:
        return list(dict.fromkeys(r.action for r in self.rows))

    @property
    def targets(self) -> list[str]:
        return list(dict.fromkeys(r.target for r in self.rows if r.target))

    @property
    def counts(self) -> dict[str, Any]:
        """The rows' counts added up key by key (numbers summed, nested objects too);
        ``chunk``, a chunk's ordinal, is left out: ``len(rows)`` is the transactions. A
        command of several actions (``drop --archive``: an archive row and a drop row per
        month, both counting the month's rows) has them per action, ``{action: counts}``:
        added together they would count each row twice."""
        if len(self.actions) > 1:
            return {action: _summed([r.counts for r in self.rows if r.action == action and isinstance(r.counts, dict)],
                                    skip=("chunk",)) for action in self.actions}
        return _summed([r.counts for r in self.rows if isinstance(r.counts, dict)], skip=("chunk",))


def _summed(parts: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key in skip:
                continue
            have = out.get(key)
            if isinstance(value, dict) and (have is None or isinstance(have, dict)):
                out[key] = _summed([have or {}, value])
            elif isinstance(value, int | float) and not isinstance(value, bool) and (
                    have is None or isinstance(have, int | float)):
                out[key] = (have or 0) + value
            else:
                out[key] = value
    return out


def commands(conn: Conn, *, since: datetime | None = None, actions: list[str] | None = None,
             limit: int = 50) -> list[AuditCommand]:
    """The newest ``limit`` commands first (by their newest row), each with all its rows
    that match: written ``since`` on, of the given ``actions``."""
    rows = fetch_all(conn, _Keyed, f"""
        WITH picked AS (
            SELECT {_COLUMNS}, {_COMMAND_KEY} AS command_key FROM operator_audit
             WHERE (%(since)s::timestamptz IS NULL OR at >= %(since)s)
               AND (%(actions)s::text[] IS NULL OR action = ANY(%(actions)s))
        ), newest AS (
            SELECT command_key, max(at) AS last_at, max(id) AS last_id FROM picked GROUP BY command_key
             ORDER BY last_at DESC, last_id DESC LIMIT %(limit)s
        )
        SELECT picked.* FROM picked JOIN newest USING (command_key)
         ORDER BY newest.last_at DESC, newest.last_id DESC, picked.id""",
        {"since": since, "actions": actions, "limit": limit})
    grouped: dict[str, list[AuditRow]] = {}
    for r in rows:
        grouped.setdefault(r.command_key, []).append(
            AuditRow(**{k: v for k, v in r.__dict__.items() if k != "command_key"}))
    return [AuditCommand(rows=group) for group in grouped.values()]


@dataclass(frozen=True, kw_only=True)
class _Keyed(AuditRow):
    command_key: str = ""
