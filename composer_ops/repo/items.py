"""MAP items: the task rows of a MAP node's items and the node's counters.

An item is a ``task_instances`` row with its MAP node's ``node_id`` and its position as
``item_index`` (the node's own row has none). Claims, heartbeats and the fenced
updates of :mod:`composer_ops.repo.tasks` treat an item like any task; what is here
reads one item, or all of one node's items at once (their creation, their outputs when
the last one finishes, their cancellation), under the run's lock and on its month
(:func:`partitions.run_tables`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from psycopg.rows import class_row

from composer_ops.core.model import ACTIVE_TASK_STATES, ItemCounts, ItemState, TaskState
from composer_ops.repo import partitions
from composer_ops.repo._base import Conn, error_json, jsonb, sql_states

__all__ = ["ANALYZE_AT", "active_items", "analyze_new_month", "count_items", "insert_items", "item_outputs",
           "item_state", "items_of", "undispatched"]

#: Items from which a MAP node's insert gives a month without statistics its first ones.
ANALYZE_AT = 500

_ACTIVE = sql_states(ACTIVE_TASK_STATES)


def _on_run(conn: Conn, statement: str, run_id: str) -> str:
    return partitions.on_tables(statement, *partitions.run_tables(conn, run_id))


def insert_items(conn: Conn, run_id: str, node_id: str, *, queue: str, task_ids: Sequence[str],
                 inputs: Sequence[Any], state: str, reason: str | None, now: datetime) -> int:
    """Insert a MAP node's items in one statement, item ``i`` with ``task_ids[i]`` and
    ``inputs[i]``, all in ``state`` (``reason`` for CANCELLED ones); returns how many."""
    finished = state in ("COMPLETED", "FAILED", "SKIPPED", "CANCELLED")
    cur = conn.execute("""
        INSERT INTO task_instances
               (id, run_id, node_id, node_type, queue, state, input_json, last_error, item_index,
                scheduled_at, finished_at, created_at, updated_at)
        SELECT r.id, %(run)s, %(node)s, 'MAP', %(queue)s, %(state)s, r.input, %(error)s, (r.n - 1)::int,
               %(now)s, %(finished)s, %(now)s, %(now)s
          FROM ROWS FROM (unnest(%(ids)s::text[]), jsonb_array_elements(%(inputs)s::jsonb)) WITH ORDINALITY
               AS r(id, input, n)""",
        {"run": run_id, "node": node_id, "queue": queue, "state": state, "error": error_json(reason),
         "ids": list(task_ids), "inputs": jsonb(list(inputs)), "now": now, "finished": now if finished else None})
    return cur.rowcount


def analyze_new_month(conn: Conn, run_id: str) -> bool:
    """Give the run's month of ``task_instances`` its first statistics, in the caller's
    transaction, if it has none (sql/R__items.sql says why); whether it did."""
    tasks = partitions.run_tables(conn, run_id)[1]
    if tasks == "task_instances":
        return False
    row = conn.execute("SELECT composer_analyze_new_tasks(%s)", (tasks,)).fetchone()
    return bool(row and row[0])


_ITEM = """
    SELECT id AS task_id, state, attempt, lease_owner, lease_expires_at, created_at, lease_expiries,
           item_index AS index
      FROM {tasks}
     WHERE run_id = %s AND id = %s AND node_id = %s AND item_index IS NOT NULL"""


def item_state(conn: Conn, run_id: str, node_id: str, task_id: str) -> ItemState | None:
    """One item of a MAP node by its task id (small columns only); None when none."""
    with conn.cursor(row_factory=class_row(ItemState)) as cur:
        cur.execute(_on_run(conn, _ITEM, run_id), (run_id, task_id, node_id))
        row = cur.fetchone()
    return None if row is None else ItemState(**{**row.__dict__, "state": TaskState(row.state)})


_OUTPUTS = """
    SELECT COALESCE(jsonb_agg(output_json ORDER BY item_index), '[]'::jsonb)
      FROM {tasks}
     WHERE run_id = %s AND node_id = %s AND item_index IS NOT NULL"""


def item_outputs(conn: Conn, run_id: str, node_id: str) -> list[Any]:
    """The outputs of a MAP node's items in item order (JSON null for an item without
    one), assembled by the server in one value."""
    row = conn.execute(_on_run(conn, _OUTPUTS, run_id), (run_id, node_id)).fetchone()
    assert row is not None
    return list(row[0])


_UNDISPATCHED = """
    SELECT item_index, id, attempt FROM {tasks}
     WHERE run_id = %s AND node_id = %s AND item_index = ANY(%s) AND state = 'PENDING'
     ORDER BY item_index"""


def undispatched(conn: Conn, run_id: str, node_id: str, indexes: Sequence[int]) -> list[tuple[int, str, int]]:
    """(index, task id, attempt) of the given items of a MAP node that are PENDING."""
    rows = conn.execute(_on_run(conn, _UNDISPATCHED, run_id), (run_id, node_id, list(indexes))).fetchall()
    return [(int(i), str(t), int(a)) for i, t, a in rows]


_COUNT = """
    UPDATE {tasks}
       SET items_total = %(total)s, items_started = %(started)s, items_done = %(done)s,
           items_failed = %(failed)s, updated_at = %(now)s
     WHERE run_id = %(run)s AND id = %(task)s AND node_id = %(node)s AND item_index IS NULL
       AND state = 'WAITING'"""


def count_items(conn: Conn, run_id: str, node_id: str, parent: str, counts: ItemCounts, *, now: datetime) -> bool:
    """Set a WAITING MAP node's counters on its own row; False when it is not waiting."""
    cur = conn.execute(_on_run(conn, _COUNT, run_id), {
        "total": counts.total, "started": counts.started, "done": counts.done, "failed": counts.failed,
        "now": now, "run": run_id, "task": parent, "node": node_id})
    return cur.rowcount == 1


_ACTIVE_ITEMS = f"""
    SELECT id FROM {{tasks}}
     WHERE run_id = %s AND node_id = ANY(%s) AND item_index IS NOT NULL AND state IN {_ACTIVE}"""


def active_items(conn: Conn, run_id: str, node_ids: Sequence[str]) -> list[str]:
    """The task ids of the active items of the given MAP nodes."""
    rows = conn.execute(_on_run(conn, _ACTIVE_ITEMS, run_id), (run_id, list(node_ids))).fetchall()
    return [str(r[0]) for r in rows]


_ITEMS_OF = """
    SELECT id FROM {tasks} WHERE run_id = %s AND node_id = ANY(%s) AND item_index IS NOT NULL"""


def items_of(conn: Conn, run_id: str, node_ids: Sequence[str]) -> list[str]:
    """The task ids of every item of the given nodes (a retry removes them with the node)."""
    if not node_ids:
        return []
    rows = conn.execute(_on_run(conn, _ITEMS_OF, run_id), (run_id, list(node_ids))).fetchall()
    return [str(r[0]) for r in rows]
