"""Workflow definitions: versions, deploy, enable/disable, soft delete."""

from __future__ import annotations

from typing import Any

from composer_ops.errors import Invalid, NotFound
from composer_ops.repo._base import Conn, fetch_all, fetch_one, jsonb
from composer_ops.repo.rows import DefinitionRow

_COLUMNS = """id, name, version, spec_json, created_by, enabled, webhook_url, deployed,
              deployed_at, deleted_at, created_at"""


def insert_version(conn: Conn, *, workflow_id: str, name: str, spec: Any, created_by: str,
                   webhook_url: str | None) -> int:
    """Store a new version (last + 1) of a definition and return its number. A
    transaction-scoped advisory lock per definition serialises concurrent deploys."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtext('composer_def:' || %s))", (workflow_id,))
    row = conn.execute("SELECT COALESCE(max(version), 0) + 1 FROM workflow_definitions WHERE id = %s",
                       (workflow_id,)).fetchone()
    version = int(row[0]) if row else 1
    conn.execute("""
        INSERT INTO workflow_definitions (id, name, version, spec_json, created_by, webhook_url)
        VALUES (%s, %s, %s, %s, %s, %s)""",
        (workflow_id, name, version, jsonb(spec), created_by, webhook_url))
    return version


def deploy(conn: Conn, workflow_id: str, version: int) -> None:
    """Mark ``version`` deployed and un-deploy every other version. A version that
    does not exist (or is deleted) is NotFound and changes nothing."""
    target = conn.execute("""SELECT 1 FROM workflow_definitions
                              WHERE id = %s AND version = %s AND deleted_at IS NULL FOR UPDATE""",
                          (workflow_id, version)).fetchone()
    if target is None:
        raise NotFound(f"workflow definition {workflow_id} v{version} does not exist")
    conn.execute("""
        UPDATE workflow_definitions
           SET deployed = (version = %(v)s),
               deployed_at = CASE WHEN version = %(v)s THEN NOW() ELSE deployed_at END
         WHERE id = %(id)s AND (deployed OR version = %(v)s)""",
        {"id": workflow_id, "v": version})


def get_deployed(conn: Conn, workflow_id: str) -> DefinitionRow:
    """The deployed version new runs use; NotFound if none, Invalid if deleted."""
    row = fetch_one(conn, DefinitionRow, f"""
        SELECT {_COLUMNS} FROM workflow_definitions
         WHERE id = %s AND deployed ORDER BY version DESC LIMIT 1""", (workflow_id,))
    if row is None:
        any_row = conn.execute("SELECT 1 FROM workflow_definitions WHERE id = %s LIMIT 1",
                               (workflow_id,)).fetchone()
        if any_row is None:
            raise NotFound(f"workflow {workflow_id!r} does not exist (deploy it first)")
        raise Invalid(f"workflow {workflow_id!r} has no deployed version")
    return row


def get_version(conn: Conn, workflow_id: str, version: int) -> DefinitionRow:
    row = fetch_one(conn, DefinitionRow,
                    f"SELECT {_COLUMNS} FROM workflow_definitions WHERE id = %s AND version = %s",
                    (workflow_id, version))
    if row is None:
        raise NotFound(f"workflow definition {workflow_id} v{version} does not exist")
    return row


def list_definitions(conn: Conn) -> list[DefinitionRow]:
    return fetch_all(conn, DefinitionRow,
                     f"SELECT {_COLUMNS} FROM workflow_definitions ORDER BY id, version", ())


def set_enabled(conn: Conn, workflow_id: str, enabled: bool) -> int:
    """Enable or disable every version of a definition; returns rows changed."""
    cur = conn.execute("UPDATE workflow_definitions SET enabled = %s WHERE id = %s AND deleted_at IS NULL",
                       (enabled, workflow_id))
    if cur.rowcount == 0:
        raise NotFound(f"workflow {workflow_id!r} does not exist")
    return cur.rowcount


def soft_delete(conn: Conn, workflow_id: str) -> int:
    """Mark every version deleted (never physically deleted: started runs still load it)."""
    cur = conn.execute("""
        UPDATE workflow_definitions SET deleted_at = NOW(), deployed = false
         WHERE id = %s AND deleted_at IS NULL""", (workflow_id,))
    if cur.rowcount == 0:
        raise NotFound(f"workflow {workflow_id!r} does not exist or is already deleted")
    return cur.rowcount
