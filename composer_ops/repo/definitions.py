"""Workflow definitions: versions, deploy, enable/disable, soft delete."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NoReturn

from composer_ops.errors import Invalid, NotFound
from composer_ops.repo import clock
from composer_ops.repo._base import Conn, fetch_one, jsonb
from composer_ops.repo.rows import DefinitionRow, StartTarget

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
    # The clock as a parameter (repo.clock): Citus refuses now() inside CASE in an
    # UPDATE of a reference table.
    conn.execute("""
        UPDATE workflow_definitions
           SET deployed = (version = %(v)s),
               deployed_at = CASE WHEN version = %(v)s THEN %(now)s::timestamptz ELSE deployed_at END
         WHERE id = %(id)s AND (deployed OR version = %(v)s)""",
        {"id": workflow_id, "v": version, "now": clock.now(conn)})


def get_deployed(conn: Conn, workflow_id: str) -> DefinitionRow:
    """The deployed version new runs use; NotFound if none, Invalid if deleted."""
    row = fetch_one(conn, DefinitionRow, f"""
        SELECT {_COLUMNS} FROM workflow_definitions
         WHERE id = %s AND deployed ORDER BY version DESC LIMIT 1""", (workflow_id,))
    if row is None:
        refuse_missing(conn, workflow_id, None)
    return row


def get_version(conn: Conn, workflow_id: str, version: int) -> DefinitionRow:
    row = fetch_one(conn, DefinitionRow,
                    f"SELECT {_COLUMNS} FROM workflow_definitions WHERE id = %s AND version = %s",
                    (workflow_id, version))
    if row is None:
        refuse_missing(conn, workflow_id, version)
    return row


def refuse_missing(conn: Conn, workflow_id: str, version: int | None) -> NoReturn:
    """The error for a definition lookup that found nothing: the deployed version
    (``version`` None) or that version."""
    if version is not None:
        raise NotFound(f"workflow definition {workflow_id} v{version} does not exist")
    any_row = conn.execute("SELECT 1 FROM workflow_definitions WHERE id = %s LIMIT 1", (workflow_id,)).fetchone()
    if any_row is None:
        raise NotFound(f"workflow {workflow_id!r} does not exist (deploy it first)")
    raise Invalid(f"workflow {workflow_id!r} has no deployed version")


_START_TARGET = """
    SELECT now() AS now, d.id, d.version, d.enabled, d.deleted_at
      FROM (SELECT 1) AS one
      LEFT JOIN LATERAL (SELECT id, version, enabled, deleted_at FROM workflow_definitions
                          WHERE id = %(id)s AND {which} ORDER BY version DESC LIMIT 1) AS d ON true"""
_START_DEPLOYED = _START_TARGET.format(which="deployed")
_START_VERSION = _START_TARGET.format(which="version = %(version)s")


def clock_and_start_target(conn: Conn, workflow_id: str, version: int | None) -> tuple[datetime, StartTarget | None]:
    """The transaction's ``now()`` and the version a new run would use (the deployed
    one, or ``version``), in one statement: what a start reads before it mints the
    run ID. None when there is no such version (see :func:`refuse_missing`). The spec
    itself is not read: the engine caches parsed specs per (id, version)."""
    query = _START_DEPLOYED if version is None else _START_VERSION
    row = conn.execute(query, {"id": workflow_id, "version": version}).fetchone()
    assert row is not None  # the outer side is one row
    now, found_id, found_version, enabled, deleted_at = row
    if found_id is None:
        return now, None
    return now, StartTarget(id=found_id, version=found_version, enabled=enabled, deleted_at=deleted_at)


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
