"""The one start path: a run inserted and its first decision, in one statement.

``Engine.start`` sends it in a pipeline, in autocommit (:func:`start_committed`): one
round trip and one implicit transaction, its result read after the commit (a refused
start wrote nothing, so committing it is harmless). The shell calls :func:`start_in` for
a SUB_WORKFLOW node's child, inside the parent's decision, and the schedules loop for a
slot's run, in their transactions.

The start is decided before the round trip, with the shell's estimate of the database
clock (:func:`estimate`, corrected by every answer), and with the definition version the
shell cached; the server checks both (sql/R__apply.sql): the run ID's recency and
partition by its own clock, the version still deployed (when the deployed one was asked
for), enabled and not deleted; every instant the decision wrote is moved to its clock.
A version found no longer current is read again, once (:class:`StaleDefinition`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

from composer_ops.core.model import CreateTask
from composer_ops.core.runids import RUN_ID_MAX_AGE, RUN_ID_MAX_AHEAD, validate_run_id
from composer_ops.engine.ids import uuid7_at
from composer_ops.engine.requests import Request
from composer_ops.errors import Conflict, Invalid, StartRefused
from composer_ops.repo import definitions, partitions, writes
from composer_ops.repo._base import Conn
from composer_ops.repo.rows import RunRow

if TYPE_CHECKING:
    from composer_ops.core.model import Decision, RunSnapshot, StartRun
    from composer_ops.engine.shell import Shell

__all__ = ["Prepared", "StaleDefinition", "Started", "estimate", "prepare_start", "creates_only", "start_committed",
           "start_in"]

_WINDOW = (RUN_ID_MAX_AGE.total_seconds(), RUN_ID_MAX_AHEAD.total_seconds())


def creates_only(decision: Decision) -> bool:
    """Whether a decision only creates tasks: a start applying it is one statement."""
    return all(isinstance(a, CreateTask) for a in decision.actions)


class StaleDefinition(Exception):
    """The cached version is no longer the one to start (re-deployed, disabled,
    deleted): read it again and start once more."""


def estimate(shell: Shell) -> datetime:
    """The shell's estimate of the database clock: this host's clock plus the offset
    seen in the last answer that carried the database's clock."""
    return datetime.now(UTC) + shell.clock_offset


def _calibrate(shell: Shell, now: datetime) -> None:
    shell.clock_offset = now - datetime.now(UTC)


@dataclass(frozen=True)
class Started:
    """A start sent; :meth:`result` reads what the database made of it."""

    shell: Shell
    run_id: str
    version: int
    pending: writes.Pending | None

    def result(self) -> tuple[str, int]:
        """``(run_id, version)``; the database's clock it answered with corrects the
        shell's estimate."""
        if self.pending is not None:
            _calibrate(self.shell, self.pending.result())
        return self.run_id, self.version


def _raise_refused(shell: Shell, refused: StartRefused, run_id: str) -> NoReturn:
    """The error of a refused start (no statement: the refusal aborted the transaction
    it was made in)."""
    _calibrate(shell, refused.now)
    if refused.why == "run_id":
        validate_run_id(run_id, refused.now)
        raise Invalid(f"run id {run_id} is not within the recency window of the database clock {refused.now}")
    if refused.why == "partition":
        raise partitions.no_partition(run_id)
    if refused.why == "definition":
        raise StaleDefinition(run_id)
    raise Conflict(f"workflow run {run_id} already exists")


def _target(conn: Conn, shell: Shell, workflow_id: str, version: int | None, run_id: str | None,
            derived: bool, refresh: bool) -> tuple[int, Any]:
    """The version to start and its spec: the cached one, or (``refresh``, or none cached)
    read with the database clock, checked in the order a start always checked: the
    run ID, its partition, then the definition."""
    key = (workflow_id, version)
    found = None if refresh else shell.start_versions.get(key)
    if found is None:
        now, row = definitions.clock_and_start_target(conn, workflow_id, version)
        _calibrate(shell, now)
        if run_id is not None:
            if not derived:
                validate_run_id(run_id, now)
            partitions.require_run_partition(conn, run_id)
        if row is None:
            definitions.refuse_missing(conn, workflow_id, version)
        if row.deleted_at is not None:
            raise Invalid(f"workflow {workflow_id!r} v{row.version} has been deleted; it accepts no new runs")
        if not row.enabled:
            raise Invalid(f"workflow {workflow_id!r} is disabled; it accepts no new runs")
        found = row.version
        shell.start_versions[key] = found
    return found, shell.definition(conn, workflow_id, found).spec


@dataclass(frozen=True)
class Prepared:
    """A start decided, not sent yet (:func:`prepare_start`)."""

    shell: Shell
    run_id: str
    version: int
    request: Request
    start: writes.NewRun
    decided: tuple[RunSnapshot, StartRun, Decision]

    @property
    def one_statement(self) -> bool:
        """Whether it is sent as one statement (a decision that only creates tasks)."""
        return creates_only(self.decided[2])

    def send(self, conn: Conn) -> Started:
        """Send it in ``conn``'s transaction, without reading the answer. A refusal
        raises :class:`StartRefused` where the statement does (here, or in a pipeline
        at its sync) and aborts the transaction: the caller says why (:func:`_raise_refused`)."""
        return Started(self.shell, self.run_id, self.version,
                       self.shell.start_sending(conn, self.request, self.start, self.decided))


def prepare_start(conn: Conn, shell: Shell, *, workflow_id: str, version: int | None, input: Any,
                  run_id: str | None, minted: list[str], request: Request,
                  parent: tuple[str, str] | None = None, started_detail: Any = None,
                  derived: bool = False, refresh: bool = False) -> Prepared:
    """Decide a run's start (:meth:`Prepared.send` sends it). ``run_id`` None mints one
    from the estimated database clock into ``minted`` (kept across the caller's retries,
    and checked by the server like a client's); a given one is checked for recency and
    partition, or, ``derived`` (a child's or a schedule slot's ID, stamped with its
    decision's instant), for its partition only. ``parent``: the run and node starting
    it; ``started_detail`` goes into the run's 'started' history row. ``refresh``: read
    the definition version again first (the only statements it may send)."""
    used, spec = _target(conn, shell, workflow_id, version, run_id, derived, refresh)
    at = estimate(shell)
    if run_id is None:
        if not minted:
            minted.append(uuid7_at(at))
        run_id = minted[0]
    context = {"input": input, "config": dict(spec.config)}
    start = writes.NewRun(workflow_id=workflow_id, version=used, deployed=version is None, input=input,
                          context=context, parent=parent, started=started_detail,
                          window=None if derived else _WINDOW)
    row = RunRow(id=run_id, workflow_id=workflow_id, workflow_version=used, status="RUNNING", context=context,
                 now=at, parent_run_id=parent[0] if parent else None, parent_node_id=parent[1] if parent else None)
    return Prepared(shell, run_id, used, request, start, shell.start_decision(conn, row))


def start_committed(conn: Conn, shell: Shell, *, workflow_id: str, version: int | None, input: Any,
                    run_id: str | None, minted: list[str], request: Request, refresh: bool) -> tuple[str, int]:
    """Start a run in a transaction of its own on ``conn`` (idle, lent by the pool). A
    start of one statement (:attr:`Prepared.one_statement`, the common case) is sent in
    one pipeline on the connection in autocommit: the statements of a pipeline up to its
    sync are one implicit transaction, committed at the sync (or rolled back whole, when
    one fails), so no BEGIN or COMMIT is sent, and the answer is read after the commit
    (a refused start wrote nothing). Any other start runs in an ordinary transaction.
    :class:`StaleDefinition` asks the caller to try once more with ``refresh``."""
    prepared = prepare_start(conn, shell, workflow_id=workflow_id, version=version, input=input, run_id=run_id,
                             minted=minted, request=request, refresh=refresh)
    try:
        if not prepared.one_statement:
            with conn.transaction():
                return prepared.send(conn).result()
        # Only statements are queued in the block. Its sync, which psycopg sends even
        # when the block raises, would commit what was queued: on an exception before
        # it, the connection is closed instead, so the server rolls the statement back
        # (and the pool drops the connection). An exception after the sync is a lost
        # acknowledgement, whose retry finds its run (Engine._start); a refusal there
        # rolled the implicit transaction back.
        with conn.pipeline():
            try:
                sent = prepared.send(conn)
            except BaseException:
                conn.close()
                raise
        return sent.result()
    except StartRefused as refused:
        _raise_refused(shell, refused, prepared.run_id)


def start_in(conn: Conn, shell: Shell, *, workflow_id: str, version: int | None, input: Any,
             run_id: str | None, minted: list[str], request: Request,
             parent: tuple[str, str] | None = None, started_detail: Any = None,
             derived: bool = False) -> tuple[str, int]:
    """Start a run in the caller's transaction (:func:`prepare_start`, sent, its answer
    read); returns ``(run_id, version)``. A taken run ID is a :class:`Conflict` that
    leaves the caller's transaction usable, as does every refusal: the start runs under
    a savepoint, rolled back to when it is refused."""
    for refresh in (False, True):
        prepared = prepare_start(conn, shell, workflow_id=workflow_id, version=version, input=input, run_id=run_id,
                                 minted=minted, request=request, parent=parent, started_detail=started_detail,
                                 derived=derived, refresh=refresh)
        try:
            try:
                with conn.transaction():
                    return prepared.send(conn).result()
            except StartRefused as refused:
                _raise_refused(shell, refused, prepared.run_id)
        except StaleDefinition:
            continue
    raise Conflict(f"workflow {workflow_id!r} changed while a run was starting; try again")
