"""Workflow runs: lock and load, insert, finish, and the read model of one run."""

from __future__ import annotations

from typing import Any

import psycopg

from composer_ops.db.errors import translate
from composer_ops.errors import Conflict, Invalid, NotFound
from composer_ops.repo._base import Conn, error_json, fetch_all, fetch_one, jsonb
from composer_ops.repo.rows import RunRow, RunView, TaskStateRow, TaskView


def lock_run(conn: Conn, run_id: str) -> RunRow:
    """Take the run's row lock for the rest of the transaction and read the database
    clock. Every state transition of a run happens under this lock, which serialises
    concurrent completions so join decisions always see each other's writes."""
    row = fetch_one(conn, RunRow, """
        SELECT id, workflow_definition_id AS workflow_id, workflow_version, status,
               context_json AS context, now() AS now
          FROM workflow_runs
         WHERE id = %s AND deleted_at IS NULL
           FOR UPDATE""", (run_id,))
    if row is None:
        raise NotFound(f"workflow run {run_id} does not exist")
    return row


def load_tasks(conn: Conn, run_id: str) -> dict[str, TaskStateRow]:
    """The state of every task of the run, keyed by node: small columns only."""
    rows = fetch_all(conn, TaskStateRow, """
        SELECT node_id, id AS task_id, state, attempt, branches,
               CASE WHEN state = 'WAITING' THEN event_name END AS event_name,
               lease_owner, lease_expires_at
          FROM task_instances WHERE run_id = %s""", (run_id,))
    return {r.node_id: r for r in rows}


def load_outputs(conn: Conn, run_id: str, node_ids: list[str]) -> dict[str, Any]:
    """The outputs of the given completed nodes of a run (and nothing else)."""
    if not node_ids:
        return {}
    cur = conn.execute("""
        SELECT node_id, output_json FROM task_instances
         WHERE run_id = %s AND node_id = ANY(%s) AND state IN ('COMPLETED', 'SUCCEEDED')""",
        (run_id, list(node_ids)))
    return {node_id: output for node_id, output in cur.fetchall()}


def insert_run(conn: Conn, *, run_id: str, workflow_id: str, workflow_version: int,
               input: Any, context: Any) -> None:
    """Create a RUNNING run. Fails if the definition is missing or deleted (NotFound /
    Invalid), if the run ID is taken (Conflict) or has no partition (Invalid)."""
    found = conn.execute(
        "SELECT deleted_at FROM workflow_definitions WHERE id = %s AND version = %s",
        (workflow_id, workflow_version)).fetchone()
    if found is None:
        raise NotFound(f"workflow definition {workflow_id} v{workflow_version} does not exist")
    if found[0] is not None:
        raise Invalid(f"workflow {workflow_id} v{workflow_version} has been deleted")
    try:
        # A savepoint, so a refused insert leaves the caller's transaction usable.
        with conn.transaction():
            cur = conn.execute("""
                INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status,
                                           input_json, context_json)
                VALUES (%s, %s, %s, 'RUNNING', %s, %s)
                ON CONFLICT (id) DO NOTHING""",
                (run_id, workflow_id, workflow_version, jsonb(input), jsonb(context)))
    except psycopg.Error as exc:
        raise translate(exc, f"insert workflow run {run_id}") from exc
    if cur.rowcount == 0:
        raise Conflict(f"workflow run {run_id} already exists")


def finish_run(conn: Conn, run_id: str, status: str, *, reason: str | None = None,
               output: Any = None) -> bool:
    """Move a non-terminal run to a terminal status; False when it already was."""
    cur = conn.execute("""
        UPDATE workflow_runs
           SET status = %s, error_json = %s, output_json = %s,
               completed_at = NOW(), updated_at = NOW()
         WHERE id = %s AND status IN ('RUNNING', 'PENDING')""",
        (status, error_json(reason), jsonb(output), run_id))
    return cur.rowcount == 1


def get_run(conn: Conn, run_id: str) -> RunView:
    """The run and all its tasks, for display (not for decisions)."""
    run = fetch_one(conn, RunView, """
        SELECT id, workflow_definition_id AS workflow_id, workflow_version, status,
               input_json AS input, output_json AS output, error_json AS error,
               created_at, updated_at, completed_at
          FROM workflow_runs WHERE id = %s AND deleted_at IS NULL""", (run_id,))
    if run is None:
        raise NotFound(f"workflow run {run_id} does not exist")
    tasks = fetch_all(conn, TaskView, """
        SELECT id, node_id, node_type, queue, state, attempt, input_json AS input,
               output_json AS output, last_error AS error, branches, wake_at, event_name,
               lease_owner, lease_expires_at, created_at, started_at, finished_at
          FROM task_instances WHERE run_id = %s
         ORDER BY created_at, id""", (run_id,))
    return RunView(**{**run.__dict__, "tasks": tasks})


def run_status(conn: Conn, run_id: str) -> str | None:
    """The run's status without locking, or None if it does not exist."""
    row = conn.execute("SELECT status FROM workflow_runs WHERE id = %s AND deleted_at IS NULL",
                       (run_id,)).fetchone()
    return None if row is None else str(row[0])
