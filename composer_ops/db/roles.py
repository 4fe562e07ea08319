"""Whether the session's role may take an operator command, asked before the command
changes anything: the one place that turns a missing privilege into the line naming
the role it needs (docs/security.md, "Logins and passwords"), rather than the server's bare
``permission denied for table ...`` halfway through.

:func:`require_owner` is for what only the schema's owner may do (migrations, dropping,
detaching, archiving, restoring or back-filling partitions); :func:`require_engine`, for
what the engine role (or the owner) may do and the reader may not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from composer_ops.db.retry import db_retry
from composer_ops.errors import PermissionDenied

ENGINE_ROLE = "composer_ops_engine"


@db_retry()
def check_first(pool: Any, check: Callable[..., None], *args: Any) -> None:
    """``check(conn, *args)`` (:func:`require_owner`, :func:`require_engine`, the audit's
    ``require_record``) on a connection of its own from ``pool``, before the command opens
    its transaction: retried on a transient error as any read is, so a connection cut
    there fails nothing."""
    with pool.connection() as conn:
        check(conn, *args)


def require_owner(conn: Any, what: str, why: str) -> None:
    """Refuse (:class:`PermissionDenied`) ``what`` unless the session's role is the
    schema's owner (it may use the role owning ``schema_migrations``) or a superuser. A
    database with no ``schema_migrations`` yet passes: its first ``migrate`` makes the owner."""
    row = conn.execute("""
        SELECT current_user::text, r.rolsuper OR pg_has_role(current_user, c.relowner, 'USAGE'),
               pg_get_userbyid(c.relowner)::text
          FROM pg_class c, pg_roles r
         WHERE c.oid = to_regclass('schema_migrations') AND r.rolname = current_user""").fetchone()
    if row is not None and not row[1]:
        raise PermissionDenied(f"{what}: role {row[0]} is not the schema's owner, which {what} needs ({why}); "
                               f"run it as the owner, {row[2]}, the role that runs composer-ops migrate "
                               "(docs/security.md)")


def require_engine(conn: Any, what: str, privilege: str, on: str) -> None:
    """Refuse (:class:`PermissionDenied`) ``what`` unless the session's role has
    ``privilege`` on the function or table ``on`` (``has_function_privilege`` for a
    signature with parentheses, else ``has_table_privilege``): what the engine role and
    the owner have, and the reader has not."""
    check = "has_function_privilege" if "(" in on else "has_table_privilege"
    row = conn.execute(f"SELECT current_user::text, {check}(%s, %s)", (on, privilege)).fetchone()
    if row is not None and not row[1]:
        raise PermissionDenied(f"{what}: role {row[0]} may not {privilege.lower()} {on}, which {what} needs; "
                               f"run it as the engine role ({ENGINE_ROLE}) or the owner (docs/security.md)")
