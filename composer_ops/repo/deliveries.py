"""Child deliveries (sql/V009): a SUB_WORKFLOW child's start, cancel or finish, written
as a row by the deciding run's transaction on Citus and applied to its target run later
(:mod:`composer_ops.engine.childrows`).

Every statement but :func:`pending` names the row's ``run_id``, so on Citus it is routed
to the one shard holding the deciding run. A delivery holds no lock on its row: each
statement here is a transaction of its own or part of the deciding run's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from composer_ops.repo._base import Conn, fetch_one, jsonb

__all__ = ["Delivery", "delete", "get", "key_text", "pending", "write"]

_COLUMNS = ("run_id, target_run_id, kind, node_id, request, workflow_id, workflow_version, input, reason, status, "
            "output, written_at")


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """One row of child_deliveries."""

    run_id: str
    target_run_id: str
    kind: str                  # start | cancel | finish
    node_id: str               # the parent's SUB_WORKFLOW node
    request: str
    workflow_id: str | None = None
    workflow_version: int | None = None
    input: Any = None
    reason: str | None = None  # a cancel's reason, a finish's error
    status: str | None = None  # a finish's run status
    output: Any = None
    written_at: datetime | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.run_id, self.target_run_id


def write(conn: Conn, d: Delivery, *, now: datetime) -> None:
    """Write ``d``, replacing the row of the same run and target: a cancel written while
    its start is pending keeps the start's workflow, version and input (applying it
    starts the child if it was not, then cancels it), so that a start still being
    applied elsewhere meets a child that exists and is cancelled."""
    conn.execute(f"""
        INSERT INTO child_deliveries ({_COLUMNS})
        VALUES (%(run)s, %(target)s, %(kind)s, %(node)s, %(request)s, %(wf)s, %(version)s, %(input)s, %(reason)s,
                %(status)s, %(output)s, %(now)s)
        ON CONFLICT (run_id, target_run_id) DO UPDATE
           SET kind = EXCLUDED.kind, node_id = EXCLUDED.node_id, request = EXCLUDED.request,
               workflow_id = COALESCE(EXCLUDED.workflow_id, child_deliveries.workflow_id),
               workflow_version = COALESCE(EXCLUDED.workflow_version, child_deliveries.workflow_version),
               input = CASE WHEN EXCLUDED.workflow_id IS NULL THEN child_deliveries.input ELSE EXCLUDED.input END,
               reason = EXCLUDED.reason, status = EXCLUDED.status, output = EXCLUDED.output,
               written_at = EXCLUDED.written_at""",
        {"run": d.run_id, "target": d.target_run_id, "kind": d.kind, "node": d.node_id, "request": d.request,
         "wf": d.workflow_id, "version": d.workflow_version, "input": jsonb(d.input), "reason": d.reason,
         "status": d.status, "output": jsonb(d.output), "now": now})


def pending(conn: Conn, limit: int, *, skip: Sequence[str] = ()) -> list[tuple[str, str]]:
    """The keys (run, target) of up to ``limit`` rows, the oldest written first, but
    those whose :func:`key_text` is in ``skip`` (backed off). On Citus this reads every
    shard (a multi-shard query cannot lock rows, FOR UPDATE, which a delivery does not need)."""
    rows = conn.execute(
        "SELECT run_id, target_run_id FROM child_deliveries WHERE run_id || ' ' || target_run_id <> ALL(%s::text[]) "
        "ORDER BY written_at LIMIT %s", (list(skip), limit)).fetchall()
    return [(str(r[0]), str(r[1])) for r in rows]


def key_text(key: tuple[str, str]) -> str:
    """A row's key as one string (run, space, target): how :func:`pending` skips it."""
    return f"{key[0]} {key[1]}"


def get(conn: Conn, run_id: str, target_run_id: str) -> Delivery | None:
    """The row as it is now, or None when it is gone."""
    return fetch_one(conn, Delivery, f"SELECT {_COLUMNS} FROM child_deliveries "
                                     "WHERE run_id = %s AND target_run_id = %s", (run_id, target_run_id))


def delete(conn: Conn, run_id: str, target_run_id: str, request: str) -> bool:
    """Delete the row if it is still the version written with ``request`` (a row written
    again since, a cancel over a start, stays to be applied)."""
    cur = conn.execute("DELETE FROM child_deliveries WHERE run_id = %s AND target_run_id = %s AND request = %s",
                       (run_id, target_run_id, request))
    return cur.rowcount > 0
