"""The run history (``run_history``): what happened to a run, written with the change.

Rows are appended in the transaction that makes the change they describe. On the
task hot path (claim, completion, failure, re-queue) the row is written by the same
statement as the change, through :func:`recorded`; the rarer events write theirs with
:func:`record`. Nothing updates or deletes a row: a run's history leaves with its
month.

Every row carries the request (the API call) that wrote it, which is what makes a
retried write recognise its own earlier commit: :func:`of_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from composer_ops.core.attempts import HistoryRow
from composer_ops.repo._base import Conn, fetch_all, jsonb
from composer_ops.repo.rows import HistoryEntry

#: Columns a history row is written with (``seq`` comes from its sequence; ``at`` is the
#: clock of the change's transaction, passed in like every time it writes: repo.clock).
_COLUMNS = "run_id, at, kind, node_id, task_id, attempt, worker, request, detail"
_SELECT = "SELECT seq, at, kind, node_id, task_id, attempt, worker, request, detail FROM run_history"


def recorded(change: str, returning: str) -> str:
    """``change`` (an UPDATE/INSERT/DELETE ... RETURNING, with named parameters) as
    one statement that also writes the history row in the ``h_*`` parameters
    (:func:`entry_params`) when, and only when, the change touched a row. The
    statement returns ``returning``, selected from the change's rows."""
    return f"""
        WITH changed AS ({change}),
             noted AS (
                INSERT INTO run_history ({_COLUMNS})
                SELECT %(h_run)s, %(h_at)s, %(h_kind)s, %(h_node)s, %(h_task)s, %(h_attempt)s, %(h_worker)s,
                       %(h_request)s, %(h_detail)s
                 WHERE EXISTS (SELECT 1 FROM changed))
        SELECT {returning} FROM changed"""


def entry_params(run_id: str, request: str, entry: HistoryEntry, *, now: datetime) -> dict[str, Any]:
    """The ``h_*`` parameters of :func:`recorded` for ``entry``, written by ``request`` at ``now``."""
    return {"h_run": run_id, "h_at": now, "h_kind": entry.kind, "h_node": entry.node_id, "h_task": entry.task_id,
            "h_attempt": entry.attempt, "h_worker": entry.worker, "h_request": request,
            "h_detail": jsonb(entry.detail)}


def record(conn: Conn, run_id: str, request: str, entries: Sequence[HistoryEntry], *, now: datetime) -> None:
    """Append ``entries`` to the run's history at ``now``, in order: one ``INSERT ...
    VALUES`` per row, pipelined (one round trip). Each names the run, so on Citus it is
    routed to the run's node and the transaction commits there in one phase (an ``INSERT
    ... SELECT`` is planned through the coordinator, docs/scaling.md)."""
    if not entries:
        return
    with conn.cursor() as cur:
        cur.executemany(f"INSERT INTO run_history ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                        [(run_id, now, e.kind, e.node_id, e.task_id, e.attempt, e.worker, request, jsonb(e.detail))
                         for e in entries])


def run_history(conn: Conn, run_id: str) -> list[HistoryRow]:
    """A run's history, oldest first (one partition, through the primary key)."""
    return fetch_all(conn, HistoryRow, f"{_SELECT} WHERE run_id = %s ORDER BY seq", (run_id,))


def of_request(conn: Conn, run_id: str, request: str) -> list[HistoryRow]:
    """The rows ``request`` wrote to the run's history: none unless a transaction of
    that request committed. Read under the run's lock, this tells a retry whether its
    lost attempt committed (the run's rows, through the primary key, filtered)."""
    return fetch_all(conn, HistoryRow, f"{_SELECT} WHERE run_id = %s AND request = %s ORDER BY seq",
                     (run_id, request))


def retries(conn: Conn, run_id: str) -> int:
    """How many times the run was retried by an operator (its ``retried`` rows)."""
    row = conn.execute("SELECT count(*) FROM run_history WHERE run_id = %s AND kind = 'retried'",
                       (run_id,)).fetchone()
    return int(row[0]) if row else 0
