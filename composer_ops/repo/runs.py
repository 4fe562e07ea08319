"""Workflow runs: lock and load, insert, finish, and the read model of one run."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from psycopg import sql
from psycopg.rows import class_row

from composer_ops.core.filters import RunFilter
from composer_ops.core.model import ItemCounts, NodeState, TaskState
from composer_ops.db.loaders import INFINITY, MINUS_INFINITY
from composer_ops.errors import BrokenRun, ComposerError, Conflict, Invalid, NotFound, StartRefused, Transient
from composer_ops.repo import history, partitions, writes
from composer_ops.repo._base import Conn, fetch_all, fetch_one, jsonb
from composer_ops.repo.rows import ChildRun, ParentRow, RunListRow, RunRow, RunView, TaskView


def lock_and_load(conn: Conn, run_id: str, *, begin: bool = False) -> tuple[RunRow, dict[str, NodeState]]:
    """Read the database clock, take the run's row lock for the rest of the
    transaction, and load the state of every task of the run keyed by node (small
    columns only: no inputs, outputs or context, which the machine asks for when it
    needs them); NotFound when the run does not exist. Every state transition of a run
    happens under this lock, which serialises concurrent completions so join decisions
    always see each other's writes. The clock (``RunRow.now``) is the event's one
    instant (:mod:`composer_ops.repo.clock`): the caller passes it to every write.

    One statement, one row: the run's load function (sql/R__apply.sql,
    ``composer_load_run_source``), whose second statement reads the tasks with a
    snapshot taken after the lock was granted, so they include everything the previous
    holder of the lock committed. On the run's month (:func:`partitions.month_tables`)
    it locks that month's partitions only, which the lock then holds until the
    transaction ends, so the rest of the event's statements on them cannot find them
    gone. A month that no longer holds the run is checked again, and the run looked
    for where the check says; a month dropped or detached since this connection
    checked it raises ``Transient``: the caller runs the transaction again, which then
    looks where the month is now.

    ``begin``: ``conn`` is in autocommit; a BEGIN goes first in the same round trip,
    opening the transaction the caller ends."""
    tables = partitions.month_tables(conn, run_id)
    found = _lock_and_load(conn, run_id, tables, begin)
    if found is None and tables.runs != "workflow_runs":
        partitions.forget_month(conn, run_id)   # the month may have been made again since it was checked
        again = partitions.month_tables(conn, run_id)
        if again != tables:
            found = _lock_and_load(conn, run_id, again, False)
    if found is None:
        raise NotFound(f"workflow run {run_id} does not exist")
    return found


@lru_cache(maxsize=512)
def _load_statement(function: str) -> str:
    return f'SELECT * FROM "{function}"(%s)'


def _lock_and_load(conn: Conn, run_id: str, tables: partitions.RunTables, begin: bool
                   ) -> tuple[RunRow, dict[str, NodeState]] | None:
    try:
        with conn.cursor() as cur:
            if begin:
                with conn.pipeline():   # the cursor's result is the last statement's: the load's
                    cur.execute("BEGIN")
                    cur.execute(_load_statement(tables.load), (run_id,))
            else:
                cur.execute(_load_statement(tables.load), (run_id,))
            row = cur.fetchone()
    except ComposerError as exc:
        if not partitions.gone_since_checked(conn, run_id, tables.runs, exc):
            raise
        raise Transient(f"workflow run {run_id}: its month's partitions changed since this connection "
                        "checked them; the transaction is to run again") from exc
    assert row is not None
    now, found, workflow_id, version, status, parent, parent_node, loaded = row
    if found is None:
        return None
    try:
        nodes = {t[0]: _node(t) for t in loaded} if loaded else {}
    except ValueError as exc:       # a state the engine does not know (odd data)
        raise BrokenRun(f"run {run_id}: {exc}, so no event can be decided on the run; repair the task's row "
                        "(its state) first") from None
    return (RunRow(id=found, workflow_id=workflow_id, workflow_version=version, status=status, now=now,
                   parent_run_id=parent, parent_node_id=parent_node), nodes)


def _node(t: list[Any]) -> NodeState:
    """One task as the load function returns it (its array of columns), for the machine."""
    (_, task_id, state, attempt, branches, signal_name, lease_owner, expires, created, wake, expiries,
     total, started, done, failed) = t
    if state not in _STATES:
        raise ValueError(f"task {task_id} of node {json.dumps(t[0])} is in state {state!r}, which the engine does "
                         "not know")
    return NodeState(task_id=task_id, state=TaskState(state), attempt=attempt,
                     branches=tuple(branches) if branches is not None else None, signal_name=signal_name,
                     lease_owner=lease_owner, lease_expires_at=_instant(expires), created_at=_instant(created),
                     wake_at=_instant(wake), lease_expiries=expiries,
                     items=None if total is None else ItemCounts(total=total, started=started or 0, done=done or 0,
                                                                 failed=failed or 0))


_STATES = frozenset(str(s) for s in TaskState)


def _instant(text: str | None) -> datetime | None:
    """A timestamptz as JSON writes it (ISO 8601 with the session's offset); an infinite
    one (odd data, such as a lease set by hand) as the latest or earliest instant."""
    if text is None:
        return None
    if text == "infinity":
        return INFINITY
    if text == "-infinity":
        return MINUS_INFINITY
    return datetime.fromisoformat(text)


_LOAD_CONTEXT = "SELECT context_json FROM {runs} WHERE id = %s"


def load_context(conn: Conn, run_id: str) -> Any:
    """The run's context (its input and its definition's config), read under the run's
    lock (:func:`lock_and_load`), on the same tables; None for a run that has none."""
    row = conn.execute(partitions.on_tables(_LOAD_CONTEXT, *partitions.run_tables(conn, run_id)),
                       (run_id,)).fetchone()
    return row[0] if row is not None else None


_LOAD_OUTPUTS = """
    SELECT node_id, output_json FROM {tasks}
     WHERE run_id = %s AND node_id = ANY(%s) AND state = 'COMPLETED' AND item_index IS NULL"""


def load_outputs(conn: Conn, run_id: str, node_ids: list[str]) -> dict[str, Any]:
    """The outputs of the given completed nodes of a run (and nothing else); read under
    the run's lock (:func:`lock_and_load`), on the same tables."""
    if not node_ids:
        return {}
    cur = conn.execute(partitions.on_tables(_LOAD_OUTPUTS, *partitions.run_tables(conn, run_id)),
                       (run_id, list(node_ids)))
    return {node_id: output for node_id, output in cur.fetchall()}


def insert_run(conn: Conn, *, run_id: str, workflow_id: str, workflow_version: int,
               input: Any, context: Any, now: datetime, request: str | None = None, started_detail: Any = None,
               parent: tuple[str, str] | None = None) -> None:
    """Create a RUNNING run with no tasks and, with ``request``, its 'started' history
    row written by that request, through the start's one write
    (:mod:`composer_ops.repo.writes`) with ``now`` as the decision's instant: what seeds
    and tests use; the engine starts runs through :mod:`composer_ops.engine.starts`.
    Refused, with nothing written and the caller's transaction usable (the write runs
    under a savepoint): a missing or deleted definition (NotFound / Invalid), a run ID
    taken (Conflict) or without a partition (Invalid)."""
    start = writes.NewRun(workflow_id=workflow_id, version=workflow_version, deployed=False, input=input,
                          context=context, parent=parent, started=started_detail)
    try:
        with conn.transaction():
            writes.send(conn, writes.document(at=now, run_id=run_id, request=request, start=start)).result()
    except StartRefused as refused:
        if refused.why == "definition":
            _check_definition(conn, workflow_id, workflow_version)
            raise Invalid(f"workflow {workflow_id} v{workflow_version} is disabled") from None
        if refused.why == "run_id":
            raise Invalid(f"run id {run_id!r} is not a canonical UUIDv7") from None
        if refused.why == "partition":
            partitions.require_run_partition(conn, run_id)
        raise Conflict(f"workflow run {run_id} already exists") from None


def _check_definition(conn: Conn, workflow_id: str, workflow_version: int) -> None:
    found = conn.execute(
        "SELECT deleted_at FROM workflow_definitions WHERE id = %s AND version = %s",
        (workflow_id, workflow_version)).fetchone()
    if found is None:
        raise NotFound(f"workflow definition {workflow_id} v{workflow_version} does not exist")
    if found[0] is not None:
        raise Invalid(f"workflow {workflow_id} v{workflow_version} has been deleted")


def reopen_run(conn: Conn, run_id: str, status: str, *, now: datetime) -> bool:
    """Move a run that is ``status`` (FAILED or CANCELLED) back to RUNNING for a retry at
    ``now`` (the event's clock), clearing its error, output and completion time; False
    when it is not ``status``."""
    cur = conn.execute("""
        UPDATE workflow_runs
           SET status = 'RUNNING', error_json = NULL, output_json = NULL, completed_at = NULL, updated_at = %s
         WHERE id = %s AND status = %s AND deleted_at IS NULL""", (now, run_id, status))
    return cur.rowcount == 1


def workflow_of(conn: Conn, run_id: str) -> tuple[str, int] | None:
    """The workflow id and version a run started on (None: no such run, or deleted)."""
    row = conn.execute("""SELECT workflow_definition_id, workflow_version FROM workflow_runs
                           WHERE id = %s AND deleted_at IS NULL""", (run_id,)).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def parent_of(conn: Conn, run_id: str) -> ParentRow | None:
    """A SUB_WORKFLOW child run's parent as it stands: its ID and node, its status and
    when its node's task was created (each None when the parent is gone: deleted or its
    month dropped; the instant None when the node has no task); None when the run has
    no parent."""
    # Reads each by one run ID (on Citus a join of two runs is not on one shard).
    child = conn.execute("SELECT parent_run_id, parent_node_id FROM workflow_runs WHERE id = %s",
                         (run_id,)).fetchone()
    if child is None or child[0] is None:
        return None
    parent, node = str(child[0]), str(child[1])
    row = conn.execute("SELECT status FROM workflow_runs WHERE id = %s AND deleted_at IS NULL", (parent,)).fetchone()
    if row is None:
        return ParentRow(run_id=parent, node_id=node, status=None, node_created_at=None)
    task = conn.execute("SELECT created_at, state FROM task_instances WHERE run_id = %s AND node_id = %s "
                        "AND item_index IS NULL", (parent, node)).fetchone()
    return ParentRow(run_id=parent, node_id=node, status=str(row[0]), node_created_at=None if task is None else task[0],
                     node_state=None if task is None else str(task[1]))


def get_run(conn: Conn, run_id: str) -> RunView:
    """The run and all its tasks, for display (not for decisions)."""
    run = fetch_one(conn, RunView, """
        SELECT id, workflow_definition_id AS workflow_id, workflow_version, status,
               input_json AS input, output_json AS output, error_json AS error,
               created_at, updated_at, completed_at, parent_run_id, parent_node_id,
               EXISTS (SELECT 1 FROM workflow_definitions d
                        WHERE d.id = workflow_definition_id AND d.version = workflow_version) AS definition_found
          FROM workflow_runs WHERE id = %s AND deleted_at IS NULL""", (run_id,))
    if run is None:
        raise NotFound(f"workflow run {run_id} does not exist")
    tasks = fetch_all(conn, TaskView, """
        SELECT id, node_id, node_type, queue, state, attempt, input_json AS input,
               output_json AS output, last_error AS error, branches, wake_at, signal_name,
               lease_owner, lease_expires_at, created_at, started_at, finished_at, item_index
          FROM task_instances WHERE run_id = %s
         ORDER BY created_at, item_index NULLS FIRST, id""", (run_id,))
    return RunView(**{**run.__dict__, "tasks": tasks, "history": history.run_history(conn, run_id),
                      "children": children_of(conn, run_id)})


def children_of(conn: Conn, run_id: str) -> list[ChildRun]:
    """The runs the SUB_WORKFLOW nodes of ``run_id`` started, oldest first, whatever
    their month: named by the run's own history ('child_started' rows), then each read
    by its ID, so on Citus every statement is a single-shard one."""
    started = conn.execute("""
        SELECT DISTINCT detail->>'child' FROM run_history
         WHERE run_id = %s AND kind = 'child_started'""", (run_id,)).fetchall()
    found: list[ChildRun] = []
    for (child,) in sorted(started):
        row = fetch_one(conn, ChildRun, """
            SELECT id, parent_node_id AS node_id, workflow_definition_id AS workflow_id, status
              FROM workflow_runs WHERE id = %s AND deleted_at IS NULL""", (child,))
        if row is not None:
            found.append(row)
    return found


def lock_for_delete(conn: Conn, run_id: str) -> tuple[str, datetime | None] | None:
    """The run's status and ``deleted_at`` under its row lock, deleted or not; None
    when there is no such run."""
    row = conn.execute("SELECT status, deleted_at FROM workflow_runs WHERE id = %s FOR UPDATE",
                       (run_id,)).fetchone()
    return None if row is None else (str(row[0]), row[1])


def lock_runs(conn: Conn, run_ids: list[str]) -> None:
    """Take the row locks of ``run_ids`` (deleted or not), in run-ID order, the lock order
    of every bulk action, for the rest of the transaction."""
    if run_ids:
        conn.execute("SELECT id FROM workflow_runs WHERE id = ANY(%s) ORDER BY id FOR UPDATE", (sorted(run_ids),))


def soft_delete(conn: Conn, run_id: str) -> datetime:
    """Mark the run deleted (``deleted_at``); the caller holds its lock and checked it
    is finished. Every loop, the claim and the reads skip a deleted run; its rows leave
    with its month."""
    row = conn.execute("UPDATE workflow_runs SET deleted_at = NOW(), updated_at = NOW() "
                       "WHERE id = %s AND deleted_at IS NULL RETURNING deleted_at", (run_id,)).fetchone()
    if row is None:
        raise Conflict(f"workflow run {run_id} was deleted concurrently")
    value: datetime = row[0]
    return value


def find_runs_query(selection: RunFilter, *, limit: int | None, after: str | None = None,
                    oldest_first: bool = False) -> tuple[sql.Composed, dict[str, Any]]:
    """The statement :func:`find_runs` runs, and its parameters. Only the conditions
    that are set are written, so the run-ID bounds of the window reach the planner as
    plain comparisons on the partition key and it skips the months outside them.
    ``limit`` None: every run it selects."""
    where = [sql.SQL("deleted_at IS NULL")]
    params: dict[str, Any] = {"limit": limit}
    if selection.id_from is not None:
        where.append(sql.SQL("id >= %(id_from)s"))
        params["id_from"] = selection.id_from
    if selection.id_to is not None:
        where.append(sql.SQL("id < %(id_to)s"))
        params["id_to"] = selection.id_to
    if after is not None:
        where.append(sql.SQL("id > %(after)s") if oldest_first else sql.SQL("id < %(after)s"))
        params["after"] = after
    if selection.workflow_id is not None:
        where.append(sql.SQL("workflow_definition_id = %(workflow)s"))
        params["workflow"] = selection.workflow_id
    if selection.statuses:
        where.append(sql.SQL("status = ANY(%(statuses)s)"))
        params["statuses"] = [str(s) for s in selection.statuses]
    if selection.contains is not None:
        where.append(sql.SQL("input_json @> %(contains)s"))
        params["contains"] = jsonb(selection.contains)
    query = sql.SQL("""
        SELECT id, workflow_definition_id AS workflow_id, workflow_version, status, input_json AS input,
               error_json AS error, created_at, completed_at
          FROM workflow_runs
         WHERE {where}
         ORDER BY id {order}
         LIMIT %(limit)s""").format(where=sql.SQL(" AND ").join(where),
                                    order=sql.SQL("ASC" if oldest_first else "DESC"))
    return query, params


def find_runs(conn: Conn, selection: RunFilter, *, limit: int, after: str | None = None,
              oldest_first: bool = False) -> list[RunListRow]:
    """Runs matching ``selection``, newest first (oldest first with ``oldest_first``),
    at most ``limit``, continuing past the run ID ``after`` when given."""
    query, params = find_runs_query(selection, limit=limit, after=after, oldest_first=oldest_first)
    with conn.cursor(row_factory=class_row(RunListRow)) as cur:
        cur.execute(query, params)
        return cur.fetchall()


def count_runs(conn: Conn, selection: RunFilter) -> int:
    """How many runs :func:`find_runs` would return for ``selection`` without a limit."""
    query, params = find_runs_query(selection, limit=None, oldest_first=True)
    row = conn.execute(sql.SQL("SELECT count(*) FROM ({}) AS selected").format(query), params).fetchone()
    return int(row[0]) if row else 0
