"""The one write of an event: its rows as one document, written by one statement.

The shell collects what a decision writes at its end (a start's run, completions,
failures and re-queues, resolved waits, the run's finish, created tasks, history rows,
dispatches) into one document (:func:`document`) and sends it as one statement
(:func:`statement` says what it does with each part, and how the instants a decision
computed are moved to the database's clock): plain SQL the client prepares, on the run's
month partitions, with no PL/pgSQL between the engine and its rows but the dispatch's
hand-off to idle workers (``composer_enqueue``, sql/R__dispatch.sql). A start sends
nothing else, so that in a pipeline in autocommit it is one round trip (engine/starts.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from psycopg import Cursor
from psycopg.types.json import Jsonb

from composer_ops.core.model import TaskRef
from composer_ops.core.runids import uuid7_timestamp
from composer_ops.db.errors import TranslatingRawCursor
from composer_ops.errors import ComposerError
from composer_ops.repo import partitions
from composer_ops.repo._base import Conn, error_doc, iso
from composer_ops.repo.outbox import dispatch_groups, dispatch_rows
from composer_ops.repo.rows import Dispatch, HistoryEntry, NewTask

__all__ = ["Done", "Fail", "Finish", "Resolve", "NewRun", "Pending", "document", "send", "statement"]


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
    document is written in (read in it), which :func:`statement` then uses as its own
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
    """A sent event write: its result is read with :meth:`result`, which in a pipeline
    is after the pipeline's sync (so a start's COMMIT goes in the same round trip)."""

    def __init__(self, cur: Cursor[Any]) -> None:
        self._cur = cur
        self._now: datetime | None = None

    def result(self) -> datetime:
        """The database's clock when the write was applied. Read once, asked any number
        of times. (A refused start raised :class:`~composer_ops.errors.StartRefused`
        where its statement did: at its execute, or at its pipeline's sync.)"""
        if self._now is None:
            row = self._cur.fetchone()
            assert row is not None
            self._now = row[1]
        return self._now


def send(conn: Conn, doc: dict[str, Any]) -> Pending:
    """Send one event's writes (``doc``, :func:`document`) as one statement
    (:func:`statement`), unread. A start whose document also updates rows (a run
    finished by its first decision) is two: the run first, then the rest. A finish
    with a webhook deletes the run's earlier delivery first (a statement of its own,
    in the same round trip in a pipeline)."""
    if "start" in doc and not _UPDATES.isdisjoint(doc):
        send(conn, {k: v for k, v in doc.items() if k in ("at", "run_id", "request", "exact", "start")})
        doc = {k: v for k, v in doc.items() if k != "start"}
    tasks, entries = doc.get("tasks", ()), doc.get("history", ())
    if len(tasks) > MAX_ROWS or len(entries) > MAX_ROWS:
        # A statement takes at most 65,535 parameters: the rows past MAX_ROWS go in
        # statements of their own, after it, in order, in the same transaction.
        first = send(conn, _rows(doc, tasks[:MAX_ROWS], entries[:MAX_ROWS]))
        for i in range(MAX_ROWS, max(len(tasks), len(entries)), MAX_ROWS):
            send(conn, _rows({k: doc[k] for k in ("at", "run_id", "request", "exact") if k in doc},
                             tasks[i:i + MAX_ROWS], entries[i:i + MAX_ROWS]))
        return first
    updates = not _UPDATES.isdisjoint(doc)
    tables = partitions.month_tables(conn, doc["run_id"]) if updates else partitions.PARTITIONED
    if "webhook" in doc.get("finish", {}):
        # A run finished again (retried) gets a new delivery, under a new ID: the row of
        # its earlier finish goes first (Citus refuses a new ID in an upsert's SET).
        conn.execute("DELETE FROM webhook_deliveries WHERE run_id = %s", (doc["run_id"],))
    text, values = statement(doc, tables.runs, tables.tasks)
    # On the partitioned tables an update is planned at every call, for its month only
    # (partitions.month_tables says why): never prepared.
    prepare = False if updates and tables.runs == "workflow_runs" else None
    # Sent as it is (its $n placeholders made once per shape, _positional).
    return Pending(TranslatingRawCursor(conn).execute(text, values, prepare=prepare))


def _rows(doc: dict[str, Any], tasks: Sequence[Any], entries: Sequence[Any]) -> dict[str, Any]:
    """``doc`` with ``tasks`` and ``history`` (its other history rows) replaced."""
    out = {k: v for k, v in doc.items() if k not in ("tasks", "history")}
    if tasks:
        out["tasks"] = list(tasks)
    if entries:
        out["history"] = list(entries)
    return out


#: The most created tasks, and the most history rows, one statement writes (13 and 7
#: parameters each; PostgreSQL's protocol allows 65,535 a statement): a document with
#: more is written by several (:func:`send`).
MAX_ROWS = 1000

#: The document's parts that update rows of the run (on its month's partitions).
_UPDATES = frozenset({"done", "failed", "resolved", "finish"})

#: The head of every event's statement: what pg_stat_statements and a fault proxy see first.
MARK = "/* composer_event */"

_JSON_PLACEHOLDER = re.compile(r"%\((\w+)\)s::jsonb")
_TERMINAL = frozenset({"COMPLETED", "FAILED", "SKIPPED", "CANCELLED"})
_ACTIVE = "('PENDING', 'QUEUED', 'RUNNING')"
_MISS = "fenced write matched no row ({}); the task changed outside the engine, the event was rolled back"


def _refuse(why: str) -> str:
    """The SQL that refuses a start: ``CO412``, why, and the database clock as detail."""
    return f"composer_fail('CO412', '{why}', to_json(now()) #>> '{{}}')"


def statement(doc: dict[str, Any], runs: str, tasks: str) -> tuple[str, list[Any]]:
    """The one statement that writes ``doc`` (:func:`document`), with PostgreSQL's own
    ``$n`` placeholders, and its parameters in their order.

    A data-modifying WITH: each part of the document a sub-statement of its own, the
    updates on the run's month partitions ``runs`` and ``tasks`` (or the partitioned
    tables: :func:`composer_ops.repo.partitions.month_tables`), the inserts as
    ``VALUES`` into the partitioned tables (routed to the run's month as they are
    inserted; on Citus, each to the run's shard). Its text depends only on the
    document's shape (which parts, how many rows), so psycopg prepares it and the
    server keeps its plan. Its last select returns ('ok', the event's instant), and
    raises where a fenced update matched no row (``CO409``: a
    :class:`~composer_ops.errors.Conflict`); a node that already has a task fails its
    insert (``unique_violation``, a Conflict too); either rolls the whole event back.

    The database's clock is the only clock: every instant written is ``now()``, or,
    ``exact``, ``at``, read in this transaction. An instant the decision computed (a
    timer's ``wake_at``, a retry's ``available_at``) is moved by ``now() - at``.

    A start (``start``) the database refuses raises ``CO412``
    (:class:`~composer_ops.errors.StartRefused`, why and the database clock), and so
    writes nothing: 'run_id' (outside the run ID's recency window by ``now()``, or not a
    UUIDv7), 'partition' (no partition of its month), 'definition' (the version is
    missing, deleted, disabled or, the deployed one asked for, no longer deployed), all
    three checked before its run is inserted; 'conflict' (the run ID is taken, its
    insert did nothing). A start carries no updates (:func:`send` splits them off)."""
    # Every JSON value travels in one parameter, an object keyed by the placeholder it
    # stands for (a value that is None is left out: SQL NULL), so one JSON dump serves
    # the statement (_text reads each as ``js -> 'key'``).
    if "start" in doc and not _UPDATES.isdisjoint(doc):
        raise ValueError("a start's statement carries no updates: send() writes them after it")
    js: dict[str, Any] = {}
    params: dict[str, Any] = {"run": doc["run_id"], "request": doc.get("request"), "at": doc["at"], "js": None}
    start = doc.get("start")
    if start is not None:
        try:
            minted = uuid7_timestamp(doc["run_id"])
        except ComposerError:
            return f"{MARK} SELECT {_refuse('run_id')}, now()", []
        params.update(part=f"workflow_runs_p{minted.year:04d}{minted.month:02d}", wf=start["wf"],
                      version=start["version"],
                      deployed=bool(start.get("deployed")), parent=start.get("parent"),
                      parent_node=start.get("parent_node"))
        js.update(input=start.get("input"), context=start.get("context"))
        if "max_age_s" in start:
            params.update(minted=minted, age=float(start["max_age_s"]),
                          ahead=float(start["max_ahead_s"]))
    history = _history(doc)
    done = doc.get("done", ())
    for k, d in enumerate(done):
        params.update({f"d{k}_t": d["t"], f"d{k}_n": d["n"], f"d{k}_a": d["a"]})
        js[f"d{k}_o"] = d.get("output")
    failed = doc.get("failed", ())
    for k, f in enumerate(failed):
        params.update({f"f{k}_t": f["t"], f"f{k}_n": f["n"], f"f{k}_a": f["a"], f"f{k}_x": int(f.get("x", 0))})
        js[f"f{k}_e"] = f.get("e")
    resolved = doc.get("resolved", ())
    for k, r in enumerate(resolved):
        params.update({f"r{k}_t": r["t"], f"r{k}_s": r["s"], f"r{k}_f": r.get("f", "ResolveWait")})
        js.update({f"r{k}_o": r.get("output"), f"r{k}_e": r.get("e")})
    finish = doc.get("finish")
    if finish is not None:
        params["fin_s"] = finish["status"]
        js.update(fin_e=finish.get("error"), fin_o=finish.get("output"))
        if "webhook" in finish:
            params["hook_url"] = finish["webhook"]["url"]
            js["hook_payload"] = finish["webhook"].get("payload")
    new_tasks = doc.get("tasks", ())
    for k, t in enumerate(new_tasks):
        total = t.get("total")
        params.update({f"t{k}_id": t["id"], f"t{k}_n": t["node"], f"t{k}_ty": t["type"], f"t{k}_q": t.get("queue"),
                       f"t{k}_s": t["state"], f"t{k}_b": t.get("branches"), f"t{k}_w": t.get("wake"),
                       f"t{k}_sig": t.get("signal"), f"t{k}_tot": total, f"t{k}_st": t.get("started"),
                       f"t{k}_z": None if total is None else 0, f"t{k}_end": t["state"] in _TERMINAL,
                       f"t{k}_ok": t["state"] == "COMPLETED"})
        js.update({f"t{k}_i": t.get("input"), f"t{k}_o": t.get("output"), f"t{k}_e": t.get("error")})
    for k, (kind, node, task, attempt, worker, detail) in enumerate(history):
        params.update({f"h{k}_k": kind, f"h{k}_n": node, f"h{k}_t": task, f"h{k}_a": attempt, f"h{k}_w": worker})
        js[f"h{k}_d"] = detail
    outbox = doc.get("outbox")
    js["outbox"] = outbox or None
    if outbox:
        params["oq"], params["on"], params["oc"], params["oo"] = dispatch_groups(outbox)
    kept = {key: value for key, value in js.items() if value is not None}
    if kept:
        params["js"] = Jsonb(kept)
    shape = (start is not None, start is not None and "max_age_s" in start, bool(doc.get("exact")), len(done),
             tuple([bool(f.get("r")) for f in failed]), len(resolved),
             None if finish is None else "webhook" in finish, len(new_tasks), len(history), bool(outbox))
    text, names = _text(shape, runs, tasks)
    return text, [params[name] for name in names]


def _history(doc: dict[str, Any]) -> list[tuple[str, Any, Any, Any, Any, Any]]:
    """The event's history rows, in the order they are numbered: the start's 'started'
    (with a request), then each completion's, failure's and re-queue's, then the rest."""
    rows: list[tuple[str, Any, Any, Any, Any, Any]] = []
    start = doc.get("start")
    if start is not None and doc.get("request") is not None:
        rows.append(("started", None, None, None, None, start.get("started")))
    for d in doc.get("done", ()):
        rows.append(("completed", d["n"], d["t"], d["a"], d.get("w"), d.get("d")))
    for f in doc.get("failed", ()):
        rows.append((f["k"], f["n"], f["t"], f["a"], f.get("w"), f.get("d")))
    for e in doc.get("history", ()):
        rows.append((e["k"], e.get("n"), e.get("t"), e.get("a"), e.get("w"), e.get("d")))
    return rows


_NAMED = re.compile(r"%\((\w+)\)s|%%|%")


def _positional(text: str) -> tuple[str, tuple[str, ...]]:
    """``text`` with its ``%(name)s`` placeholders as PostgreSQL's ``$n`` (one number
    per name, in order of first use) and ``%%`` as ``%``, and the names in number order.
    psycopg converts a statement with named placeholders at every execute once it is
    longer than 4 kB or has more than 50 parameters (an event that creates several
    tasks: 2 to 3 ms of the worker's CPU per 10-task fan-out run, docs/performance-log.md);
    this is done once per shape (:func:`_text`), and the statement sent as it is."""
    names: dict[str, int] = {}

    def number(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return f"${names.setdefault(m.group(1), len(names) + 1)}"
        if m.group(0) == "%%":
            return "%"
        raise ValueError(f"a lone % at character {m.start()} of an event's statement")

    return _NAMED.sub(number, text), tuple(names)


@lru_cache(maxsize=1024)
def _text(shape: tuple[Any, ...], runs: str, tasks: str) -> tuple[str, tuple[str, ...]]:
    """The statement of a document of this shape (:func:`statement`), and the names
    of its parameters in the order of its ``$n`` placeholders."""
    is_start, window, exact, n_done, failed, n_resolved, finish, n_tasks, n_history, outbox = shape
    at = "%(at)s::timestamptz" if exact else "now()"
    shift = "" if exact else " + (now() - %(at)s::timestamptz)"
    parts: list[str] = []
    checks: list[str] = []
    if is_start:
        in_window = ("%(minted)s::timestamptz BETWEEN now() - make_interval(secs => %(age)s::float8)"
                     " AND now() + make_interval(secs => %(ahead)s::float8)") if window else "true"
        # First: a refusal raises before the run's insert (in PostgreSQL, which reads chk
        # first; on Citus, which runs the WITH's parts in order).
        parts.append(f"""chk AS MATERIALIZED (
    SELECT CASE WHEN NOT ({in_window}) THEN {_refuse('run_id')}
                WHEN to_regclass(%(part)s::text) IS NULL THEN {_refuse('partition')}
                WHEN NOT EXISTS (SELECT FROM workflow_definitions d
                                  WHERE d.id = %(wf)s::text AND d.version = %(version)s::int
                                    AND d.deleted_at IS NULL AND d.enabled
                                    AND (d.deployed OR NOT %(deployed)s::boolean)) THEN {_refuse('definition')}
           END AS refused)""")
        parts.append(f"""r AS (
    INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, input_json, context_json,
                               parent_run_id, parent_node_id, created_at, updated_at)
    VALUES (%(run)s::text, %(wf)s::text, %(version)s::int, 'RUNNING', %(input)s::jsonb, %(context)s::jsonb,
            %(parent)s::text, %(parent_node)s::text, {at}, {at})
    ON CONFLICT (id) DO NOTHING RETURNING id)""")
        checks += ["WHEN (SELECT refused FROM chk) IS NOT NULL THEN NULL",
                   f"WHEN NOT EXISTS (SELECT FROM r) THEN {_refuse('conflict')}"]
    for k in range(n_done):
        parts.append(f"""d{k} AS (
    UPDATE "{tasks}" t
       SET state = 'COMPLETED', output_json = %(d{k}_o)s::jsonb, completed_at = {at}, finished_at = {at},
           updated_at = {at}, lease_owner = NULL, lease_expires_at = NULL
     WHERE t.run_id = %(run)s::text AND t.id = %(d{k}_t)s::text AND t.node_id = %(d{k}_n)s::text
       AND t.attempt = %(d{k}_a)s::int AND t.state IN {_ACTIVE} RETURNING 1)""")
        checks.append(f"WHEN NOT EXISTS (SELECT FROM d{k}) THEN "
                      f"composer_fail('CO409', '{_MISS.format('CompleteTask')}')")
    for k, requeue in enumerate(failed):
        sets = ("state = 'PENDING', attempt = t.attempt + 1, lease_expiries = t.lease_expiries + %(f{k}_x)s::int, "
                "started_at = NULL" if requeue else f"state = 'FAILED', finished_at = {at}").replace("{k}", str(k))
        parts.append(f"""f{k} AS (
    UPDATE "{tasks}" t
       SET {sets}, last_error = %(f{k}_e)s::jsonb, updated_at = {at}, lease_owner = NULL, lease_expires_at = NULL
     WHERE t.run_id = %(run)s::text AND t.id = %(f{k}_t)s::text AND t.node_id = %(f{k}_n)s::text
       AND t.attempt = %(f{k}_a)s::int AND t.state IN {_ACTIVE} RETURNING 1)""")
        action = "RequeueTask" if requeue else "FailTask"
        checks.append(f"WHEN NOT EXISTS (SELECT FROM f{k}) THEN composer_fail('CO409', '{_MISS.format(action)}')")
    for k in range(n_resolved):
        parts.append(f"""v{k} AS (
    UPDATE "{tasks}" t
       SET state = %(r{k}_s)s::text, output_json = %(r{k}_o)s::jsonb, last_error = %(r{k}_e)s::jsonb,
           finished_at = {at}, updated_at = {at}, completed_at = CASE WHEN %(r{k}_s)s::text = 'COMPLETED' THEN {at} END
     WHERE t.run_id = %(run)s::text AND t.id = %(r{k}_t)s::text AND t.state = 'WAITING' RETURNING 1)""")
        checks.append(f"WHEN NOT EXISTS (SELECT FROM v{k}) THEN composer_fail('CO409', "
                      f"format('{_MISS.format('%%s')}', %(r{k}_f)s::text))")
    if finish is not None:
        parts.append(f"""fin AS (
    UPDATE "{runs}" r
       SET status = %(fin_s)s::text, error_json = %(fin_e)s::jsonb, output_json = %(fin_o)s::jsonb,
           completed_at = {at}, updated_at = {at}
     WHERE r.id = %(run)s::text AND r.status IN ('PENDING', 'RUNNING') RETURNING 1)""")
        checks.append("WHEN NOT EXISTS (SELECT FROM fin) THEN composer_fail('CO409', "
                      "format('run %%s finished concurrently; the decision was rolled back', %(run)s::text))")
        if finish:      # its earlier delivery deleted first (send)
            parts.append(f"""hook AS (
    INSERT INTO webhook_deliveries (run_id, url, payload, next_attempt_at, created_at)
    VALUES (%(run)s::text, %(hook_url)s::text, %(hook_payload)s::jsonb, {at}, {at}))""")
    if n_tasks:
        rows = ",\n           ".join(
            f"(%(t{k}_id)s::text, %(run)s::text, %(t{k}_n)s::text, %(t{k}_ty)s::text, %(t{k}_q)s::text, "
            f"%(t{k}_s)s::text, %(t{k}_i)s::jsonb, %(t{k}_o)s::jsonb, %(t{k}_e)s::jsonb, %(t{k}_b)s::text[], "
            f"%(t{k}_w)s::timestamptz{shift}, %(t{k}_sig)s::text, %(t{k}_tot)s::int, %(t{k}_st)s::int, "
            f"%(t{k}_z)s::int, %(t{k}_z)s::int, {at}, CASE WHEN %(t{k}_end)s::boolean THEN {at} END, "
            f"CASE WHEN %(t{k}_ok)s::boolean THEN {at} END, {at}, {at})" for k in range(n_tasks))
        # A node that already has a task fails the insert (unique_violation on the (run_id,
        # node_id) index, naming the node: a Conflict), which rolls the event back. A
        # plain insert, no check after it: on Citus each check of a part's result is a
        # subplan of its own, a round trip to a node.
        parts.append(f"""new_tasks AS (
    INSERT INTO task_instances (id, run_id, node_id, node_type, queue, state, input_json, output_json, last_error,
                                branches, wake_at, signal_name, items_total, items_started, items_done, items_failed,
                                scheduled_at, finished_at, completed_at, created_at, updated_at)
    VALUES {rows})""")
    if n_history:       # numbered in the order of VALUES
        rows = ",\n           ".join(
            f"(%(run)s::text, {at}, %(h{k}_k)s::text, %(h{k}_n)s::text, %(h{k}_t)s::text, %(h{k}_a)s::int, "
            f"%(h{k}_w)s::text, %(request)s::text, %(h{k}_d)s::jsonb)" for k in range(n_history))
        parts.append(f"""entries AS (
    INSERT INTO run_history (run_id, at, kind, node_id, task_id, attempt, worker, request, detail)
    VALUES {rows})""")
    enqueued = ""
    if outbox:
        moved = "interval '0'" if exact else "now() - %(at)s::timestamptz"
        # In FROM: a column of its own would be of type void, which Citus cannot keep as
        # an intermediate result.
        parts.append(f"""dispatch AS (SELECT 1 FROM composer_enqueue(%(outbox)s::jsonb, {at}, {moved}, %(oq)s::text[],
                                          %(on)s::text[], %(oc)s::int[], %(oo)s::int[]) AS e)""")
        enqueued = ", EXISTS (SELECT FROM dispatch)"
    status = "CASE " + " ".join(checks) + " ELSE 'ok' END" if checks else "'ok'"
    head = "WITH " + ",\n".join(parts) + "\n" if parts else ""
    # Each JSON placeholder read from the one JSON parameter (statement).
    return _positional(_JSON_PLACEHOLDER.sub(r"(%(js)s::jsonb -> '\1')",
                                             f"{MARK}\n{head}SELECT {status}, {at}{enqueued}"))
