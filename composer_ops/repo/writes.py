"""The one write of an event: its rows as one JSON document, written by ``composer_apply``.

The shell collects what a decision writes at its end (a start's run, completions,
failures and re-queues, resolved waits, the run's finish, created tasks, history rows,
dispatches) into one document and sends it as one statement (sql/R__apply.sql says what
the function does with each part, and how the instants a decision computed are moved to
the database's clock). A start sends nothing else, so that with BEGIN and COMMIT pipelined
it is one round trip (engine/starts.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import Cursor
from psycopg.types.json import Jsonb

from composer_ops.core.model import TaskRef
from composer_ops.repo._base import Conn, error_doc, iso
from composer_ops.repo.outbox import dispatch_rows
from composer_ops.repo.rows import Dispatch, HistoryEntry, NewTask

__all__ = ["Done", "Fail", "Finish", "Resolve", "NewRun", "Pending", "Refused", "document", "send"]


class Refused(Exception):
    """A start ``composer_apply`` refused, writing nothing (sql/R__apply.sql): ``why`` is
    'run_id', 'partition', 'definition' or 'conflict'; ``now`` the database's clock.
    Not an error of the caller's: :mod:`composer_ops.engine.starts` says what was wrong."""

    def __init__(self, why: str, now: datetime) -> None:
        super().__init__(why)
        self.why, self.now = why, now


@dataclass(frozen=True, kw_only=True)
class NewRun:
    """The run a start inserts (``start`` in the document)."""

    workflow_id: str
    version: int
    deployed: bool                  # the caller asked for the deployed version: refused if it no longer is
    input: Any
    context: Any
    parent: tuple[str, str] | None = None
    started: Any = None             # the detail of its 'started' history row
    window: tuple[float, float] | None = None   # the run ID's recency window (max age, max ahead), seconds


@dataclass(frozen=True, kw_only=True)
class Done:
    """A CompleteTask (``done``): the attempt to complete, fenced, and its history row."""

    ref: TaskRef
    output: Any
    entry: HistoryEntry


@dataclass(frozen=True, kw_only=True)
class Fail:
    """A FailTask or, with ``requeue``, a RequeueTask (``failed``): the attempt, fenced, its
    error and history row; a re-queue's next attempt is ``ref.attempt + 1``, whose dispatch
    the caller puts in the document's outbox."""

    ref: TaskRef
    reason: str | None
    entry: HistoryEntry
    requeue: bool = False
    lease_expired: bool = False


@dataclass(frozen=True, kw_only=True)
class Resolve:
    """A WAITING task resolved (``resolved``): a wait's timer or signal (ResolveWait), a
    child run's end (FinishChild), a MAP's last item (FinishMap); ``action`` names it in
    the error of a fence miss."""

    task_id: str
    state: str
    output: Any = None
    reason: str | None = None
    action: str = "ResolveWait"


@dataclass(frozen=True, kw_only=True)
class Finish:
    """A FinishRun (``finish``), with the webhook delivery (url, payload) of a definition
    that has one."""

    status: str
    reason: str | None
    output: Any
    webhook: tuple[str, Any] | None = None


def document(*, at: datetime, run_id: str, request: str | None, start: NewRun | None = None,
             done: Sequence[Done] = (), failed: Sequence[Fail] = (), resolved: Sequence[Resolve] = (),
             finish: Finish | None = None, tasks: Sequence[NewTask] = (),
             history: Sequence[HistoryEntry] = (),
             outbox: Sequence[Dispatch] = (), exact: bool = False) -> dict[str, Any]:
    """The document of one event's writes, decided at ``at``; keys whose value is None
    are left out (SQL NULL). ``exact``: ``at`` is the clock of the transaction the
    document is written in (read in it), which ``composer_apply`` then uses as its own
    rather than its ``now()``: the one clock of the event, whichever node runs it."""
    doc: dict[str, Any] = _compact({"at": iso(at), "run_id": run_id, "request": request,
                                    "exact": True if exact else None})
    if start is not None:
        run: dict[str, Any] = {"wf": start.workflow_id, "version": start.version, "deployed": start.deployed,
                               "input": start.input, "context": start.context, "started": start.started}
        if start.parent is not None:
            run["parent"], run["parent_node"] = start.parent
        if start.window is not None:
            run["max_age_s"], run["max_ahead_s"] = start.window
        doc["start"] = _compact(run)
    if done:
        doc["done"] = [_compact({"t": d.ref.task_id, "n": d.ref.node_id, "a": d.ref.attempt, "output": d.output,
                                 "w": d.entry.worker, "d": d.entry.detail}) for d in done]
    if failed:
        doc["failed"] = [_compact({"t": f.ref.task_id, "n": f.ref.node_id, "a": f.ref.attempt, "k": f.entry.kind,
                                   "e": error_doc(f.reason), "r": f.requeue, "x": int(f.lease_expired),
                                   "w": f.entry.worker, "d": f.entry.detail}) for f in failed]
    if resolved:
        doc["resolved"] = [_compact({"t": r.task_id, "s": r.state, "output": r.output, "e": error_doc(r.reason),
                                     "f": r.action}) for r in resolved]
    if finish is not None:
        doc["finish"] = _compact({"status": finish.status, "error": error_doc(finish.reason), "output": finish.output,
                                  "webhook": None if finish.webhook is None
                                  else {"url": finish.webhook[0], "payload": finish.webhook[1]}})
    if tasks:
        doc["tasks"] = [_compact({
            "id": r.task_id, "node": r.node_id, "type": r.node_type, "queue": r.queue, "state": r.state,
            "input": r.input, "output": r.output, "error": error_doc(r.error),
            "branches": None if r.branches is None else list(r.branches), "wake": iso(r.wake_at),
            "signal": r.signal_name, "total": r.items_total, "started": r.items_started}) for r in tasks]
    if history:
        doc["history"] = [_compact({"k": e.kind, "n": e.node_id, "t": e.task_id, "a": e.attempt, "w": e.worker,
                                    "d": e.detail}) for e in history]
    if outbox:
        doc["outbox"] = dispatch_rows(outbox)
    return doc


def _compact(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if v is not None}


class Pending:
    """A sent ``composer_apply``: its result is read with :meth:`result`, which in a
    pipeline is after the pipeline's sync (so a start's COMMIT goes in the same round trip)."""

    def __init__(self, cur: Cursor[Any]) -> None:
        self._cur = cur
        self._out: dict[str, Any] | None = None

    def result(self) -> datetime:
        """The database's clock when the write was applied; :class:`Refused` when a
        start was refused (and nothing written). Read once, asked any number of times."""
        if self._out is None:
            row = self._cur.fetchone()
            assert row is not None
            self._out = row[0]
        out = self._out
        now = datetime.fromisoformat(str(out["now"]))
        if out["status"] != "ok":
            raise Refused(str(out["status"]), now)
        return now


def send(conn: Conn, doc: dict[str, Any]) -> Pending:
    """Send one event's writes as one statement."""
    return Pending(conn.execute("SELECT composer_apply_on(%s, %s)", (doc["run_id"], Jsonb(doc))))
