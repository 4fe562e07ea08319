"""Operator actions on runs and workers: find runs, see workers.

A selection of runs is checked whole before anything is read (``core.selection``: a
bad status, window or ``--where`` is :class:`Invalid`); ages in the window are then
counted back from the database clock in the transaction that reads the runs.

Reads here run in one REPEATABLE READ, read-only transaction, so the figures of one
answer (a worker's state and the leases it holds) come from one snapshot and one
database clock.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

import psycopg

from composer_ops.core.actor import Actor
from composer_ops.core.children import child_run_id
from composer_ops.core.filters import RunFilter
from composer_ops.core.model import ACTIVE_RUN_STATUSES, CancelRun, RetryRun, RunStatus, TaskState
from composer_ops.core.rerun import child_left_to_parent
from composer_ops.core.selection import Selection, check_limit
from composer_ops.db import roles
from composer_ops.db.errors import TranslatingPool
from composer_ops.db.retry import db_retry
from composer_ops.engine.requests import Request
from composer_ops.engine.shell import Shell
from composer_ops.errors import BrokenRun, Conflict, Invalid, LockTimeout, NotFound, PermissionDenied
from composer_ops.repo import audit, definitions, partitions, retention, runs, workers
from composer_ops.repo._base import repeatable_read
from composer_ops.repo.rows import DefinitionRow, LeaseRow, ParentRow, RunListRow, WorkerRow

__all__ = ["CANCEL_CHUNK", "RETRY_LIMIT", "BulkRetry", "CancelChunk", "CancelResult", "RetryResult",
           "WorkerReport", "cancel_runs", "find_runs", "retry_run", "retry_runs", "workers_report"]


def find_runs(pool: TranslatingPool, chosen: Selection, *, limit: int = 50) -> tuple[RunFilter, list[RunListRow]]:
    """The runs ``chosen`` selects, newest first, at most ``limit``; with the filter as
    resolved (the window as instants by the database clock)."""
    check_limit(limit)
    return _selected(pool, chosen, limit=limit, oldest_first=False)


@db_retry()
def _selected(pool: TranslatingPool, chosen: Selection, *, limit: int,
              oldest_first: bool) -> tuple[RunFilter, list[RunListRow]]:
    """The filter as resolved in one snapshot and, unless ``limit`` is 0, the first
    ``limit`` runs it selects; a read, so retried as a whole on a transient error."""
    with _snapshot(pool) as conn:
        resolved = chosen.resolve(partial(retention.resolve, conn))
        found = runs.find_runs(conn, resolved, limit=limit, oldest_first=oldest_first) if limit else []
        return resolved, found


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """What ``composer-ops workers list`` shows."""

    workers: list[WorkerRow]
    leases: list[LeaseRow] = field(default_factory=list)        # held by workers that are not live
    unregistered: list[str] = field(default_factory=list)      # lease owners absent from the registry

    @property
    def dead(self) -> list[WorkerRow]:
        return [w for w in self.workers if w.state == "dead"]


@contextlib.contextmanager
def _snapshot(pool: TranslatingPool) -> Iterator[psycopg.Connection[Any]]:
    with pool.connection() as conn, conn.transaction():
        repeatable_read(conn, read_only=True)
        yield conn


@db_retry()
def workers_report(pool: TranslatingPool, *, window_s: float | None = None) -> WorkerReport:
    """The registry judged by the database clock (:func:`repo.workers.list_workers`),
    the leases of the workers that are not live, and unregistered lease owners."""
    with _snapshot(pool) as conn:
        found = workers.list_workers(conn, window_s=window_s)
        gone = [w.id for w in found if w.state != "live" and w.running]
        return WorkerReport(workers=found, leases=workers.leases_of(conn, gone),
                            unregistered=workers.unregistered_owners(conn))


# -- bulk cancel ------------------------------------------------------------------------

#: Runs cancelled per transaction by ``runs cancel``.
CANCEL_CHUNK = 50
#: Runs a dry run lists at most.
DRY_RUN_LIST = 1000
#: Seconds a bulk cancel's dry run waits for a run's lock; then it lists the run undecided.
DRY_RUN_LOCK_WAIT_S = 1.0


@dataclass(frozen=True, kw_only=True)
class CancelChunk:
    """One committed transaction of a bulk cancel."""

    number: int
    cancelled: list[str]
    skipped: list[str]           # finished (or deleted) between being listed and being locked
    refused: list[tuple[str, str]] = field(default_factory=list)   # (run ID, why): odd data (BrokenRun)
    duplicate: bool = False       # an earlier attempt committed; its audit row was read back
    locked: list[str] = field(default_factory=list)   # a dry run: locked by another session, not decided


@dataclass(frozen=True, kw_only=True)
class CancelResult:
    """What ``runs cancel`` did (``applied``) or would do."""

    selection: RunFilter
    applied: bool
    chunks: list[CancelChunk] = field(default_factory=list)
    would_cancel: list[str] = field(default_factory=list)   # a dry run: the active runs selected (at most
    more: bool = False                                      # DRY_RUN_LIST; ``more`` when there are others)
    would_refuse: list[tuple[str, str]] = field(default_factory=list)   # a dry run: those it would refuse
    #: a dry run: runs whose lock another session held past DRY_RUN_LOCK_WAIT_S: not decided
    locked: list[str] = field(default_factory=list)
    #: a dry run decided each run (else, for a role that may only read, listed them only)
    decided: bool = True

    @property
    def cancelled(self) -> list[str]:
        return [r for c in self.chunks for r in c.cancelled]

    @property
    def skipped(self) -> list[str]:
        return [r for c in self.chunks for r in c.skipped]

    @property
    def refused(self) -> list[tuple[str, str]]:
        return [r for c in self.chunks for r in c.refused]


def _active(chosen: Selection) -> Selection:
    """``chosen`` narrowed to the runs a cancel applies to: the active ones."""
    wanted = tuple(s for s in chosen.statuses if s in ACTIVE_RUN_STATUSES) if chosen.statuses else tuple(
        s for s in RunStatus if s in ACTIVE_RUN_STATUSES)
    if chosen.statuses and not wanted:
        raise Invalid(f"--status {','.join(chosen.statuses)}: only PENDING and RUNNING runs can be cancelled")
    return Selection(workflow_id=chosen.workflow_id, statuses=wanted, since=chosen.since, until=chosen.until,
                     contains=chosen.contains)


def cancel_runs(shell: Shell, chosen: Selection, *, reason: str, yes: bool, actor: Actor | None = None,
                chunk: int = CANCEL_CHUNK, on_chunk: Callable[[CancelChunk], None] | None = None,
                request_id: str | None = None, on_total: Callable[[int], None] | None = None) -> CancelResult:
    """Cancel every active run ``chosen`` selects, through the engine's cancel event.

    The runs are taken oldest first, ``chunk`` per transaction; in each, every run is
    locked in run-ID order and cancelled by the state machine (its active tasks and
    their dispatches go with it), and one audit row records the chunk. A run that
    finished between being listed and being locked is skipped. Each chunk commits on
    its own, so an interrupted cancel keeps what it did and running it again cancels
    the rest: every run is cancelled once. A chunk retried after its connection was
    lost (its COMMIT acknowledged or not, or still under way) first locks the runs it
    lists, then finds its audit row when the earlier attempt committed, and reports
    what that attempt did. A run no event can be decided on (:class:`BrokenRun`: its
    definition version missing, a task in an unknown state) is refused with why, and the
    chunk goes on. Without ``yes`` the same chunks are decided and rolled back, up to
    DRY_RUN_LIST runs: the result lists the runs it would cancel and those it would
    refuse. ``on_total`` is told, before the first chunk, how many runs the selection
    holds (what a progress bar counts to)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 1000:
        raise Invalid(f"chunk must be an integer from 1 to 1000, got {chunk!r}")
    if not isinstance(reason, str) or not reason.strip() or len(reason) > 1000:
        raise Invalid("the reason must be non-empty text of at most 1000 characters")
    if not chosen.workflow_id and chosen.since is None and chosen.until is None and chosen.contains is None:
        raise Invalid("say which runs to cancel: give --where, --workflow, --since or --until "
                      "(--since 100y selects every run)")
    active = _active(chosen)
    request = request_id or uuid.uuid4().hex
    if not yes:
        try:
            return _cancel_chunks(shell, active, reason, False, actor, chunk, on_chunk, request, on_total)
        except PermissionDenied:
            # A role that may only read cannot take the run locks a decided dry run takes:
            # it gets the runs the selection holds, listed, not decided (``decided``).
            resolved, found = _selected(shell.pool, active, limit=DRY_RUN_LIST + 1, oldest_first=True)
            return CancelResult(selection=resolved, applied=False, would_cancel=[r.id for r in found[:DRY_RUN_LIST]],
                                more=len(found) > DRY_RUN_LIST, decided=False)
    # a reader: one line naming the role, before any lock
    roles.check_first(shell.pool, audit.require_record, "runs cancel")
    return _cancel_chunks(shell, active, reason, True, actor, chunk, on_chunk, request, on_total)


def _cancel_chunks(shell: Shell, active: Selection, reason: str, yes: bool, actor: Actor | None, chunk: int,
                   on_chunk: Callable[[CancelChunk], None] | None, request: str,
                   on_total: Callable[[int], None] | None) -> CancelResult:
    resolved, _ = _selected(shell.pool, active, limit=0, oldest_first=True)   # once: every chunk, one window
    if yes and on_total is not None:
        on_total(_count(shell.pool, resolved))
    done: list[CancelChunk] = []
    after: str | None = None
    seen = 0
    while yes or seen <= DRY_RUN_LIST:
        number = len(done) + 1
        size = chunk if yes else min(CANCEL_CHUNK, DRY_RUN_LIST + 1 - seen)
        tries = [0]
        try:
            step = _cancel_chunk(shell, resolved, after, size, reason, actor, f"{request}:{number}", number, tries,
                                 yes=yes)
        except LockTimeout as exc:                   # --yes: the chunk rolled back; those before it stay done
            before = sum(len(c.cancelled) for c in done)
            kept = f"the {before} run(s) cancelled before it stay cancelled" if done else ""
            raise shell.run_locked(exc, retried=tries[0] > 1, kept=kept) from exc
        if step is None:
            break
        done.append(step)
        if on_chunk is not None and yes:
            on_chunk(step)
        listed = step.cancelled + step.skipped + [r for r, _ in step.refused] + step.locked
        seen += len(listed)
        after = max(listed)
    if yes:
        return CancelResult(selection=resolved, applied=True, chunks=done)
    # A dry run: the chunks were decided and rolled back; one run past the list was
    # taken, to know there are more.
    more = seen > DRY_RUN_LIST
    would = [r for c in done for r in c.cancelled if not (more and r == after)]
    refused = [r for c in done for r in c.refused if not (more and r[0] == after)]
    locked = [r for c in done for r in c.locked if not (more and r == after)]
    return CancelResult(selection=resolved, applied=False, would_cancel=would, would_refuse=refused, more=more,
                        locked=locked)


@db_retry()
def _count(pool: TranslatingPool, selection: RunFilter) -> int:
    with _snapshot(pool) as conn:
        return runs.count_runs(conn, selection)


@db_retry(give_up=(LockTimeout,))
def _cancel_chunk(shell: Shell, selection: RunFilter, after: str | None, chunk: int, reason: str,
                  actor: Actor | None, request: str, number: int, tries: list[int], *,
                  yes: bool = True) -> CancelChunk | None:
    """One chunk in one transaction (rolled back without ``yes``); None when no active
    run is left to select."""
    tries[0] += 1
    with shell.pool.connection() as conn, conn.transaction(force_rollback=not yes), \
            contextlib.nullcontext() if yes else shell.rehearsal():
        if not yes:
            # A dry run waits for a run's lock (a worker's completion, an operator's
            # session) at most DRY_RUN_LOCK_WAIT_S: that run is listed, not decided.
            partitions.set_lock_timeout(conn, DRY_RUN_LOCK_WAIT_S, citus=shell.on_citus(conn))
        else:
            shell.operator_lock_timeout(conn)
        listed = [r.id for r in runs.find_runs(conn, selection, limit=chunk, after=after, oldest_first=True)]
        if tries[0] > 1 and yes:
            # An earlier attempt may still be committing: it holds the locks of the runs
            # listed here (the same ones, as long as it has not committed), so take them
            # before looking for its audit row, which a new snapshot then sees.
            runs.lock_runs(conn, listed)
            earlier = audit.of_request(conn, request)
            if earlier:
                detail = earlier[0].detail or {}
                return CancelChunk(number=number, cancelled=list(detail.get("cancelled", [])),
                                   skipped=list(detail.get("skipped", [])),
                                   refused=[(r, "refused (its reason is in the first attempt's output)")
                                            for r in detail.get("refused", [])], duplicate=True)
        if not listed:
            return None
        cancelled: list[str] = []
        skipped: list[str] = []
        refused: list[tuple[str, str]] = []
        locked: list[str] = []
        noted = Request(id=request, operator=audit.operator_note("runs cancel", actor))   # in each run's history
        for run_id in listed:                       # ascending: the lock order of every bulk action
            try:
                with conn.transaction():            # a savepoint: a run refused leaves the others' cancels
                    outcome = shell.handle_in(conn, run_id, partial(_cancel_event, reason), request=noted)
            except (Conflict, NotFound):             # finished or deleted since it was listed
                skipped.append(run_id)
                continue
            except BrokenRun as exc:                 # odd data: no event can be decided on it
                refused.append((run_id, str(exc)))
                continue
            except LockTimeout as exc:
                if yes:                              # the whole chunk rolls back: the caller names the holder
                    exc.run_id = exc.run_id or run_id
                    raise
                locked.append(run_id)                # a dry run's wait ran out: listed, not decided
                continue
            (cancelled if outcome.applied else skipped).append(run_id)
        if yes:
            audit.record(conn, "runs cancel", actor=actor, target=_describe(selection), request=request,
                         counts={"cancelled": len(cancelled), "skipped": len(skipped), "chunk": number,
                                 **({"refused": len(refused)} if refused else {})},
                         detail={"cancelled": cancelled, "skipped": skipped, "reason": reason,
                                 **({"refused": [r for r, _ in refused]} if refused else {})})
        return CancelChunk(number=number, cancelled=cancelled, skipped=skipped, refused=refused, locked=locked)


def _cancel_event(reason: str, now: datetime) -> CancelRun:
    return CancelRun(reason=reason, now=now)


def _describe(selection: RunFilter) -> str:
    """A selection in one line, for the audit row's target."""
    parts = []
    if selection.workflow_id:
        parts.append(f"workflow={selection.workflow_id}")
    if selection.statuses:
        parts.append("status=" + ",".join(selection.statuses))
    if selection.since is not None:
        parts.append(f"since={selection.since.isoformat()}")
    if selection.until is not None:
        parts.append(f"until={selection.until.isoformat()}")
    if selection.contains is not None:
        parts.append("input@>" + json.dumps(selection.contains, separators=(",", ":"), ensure_ascii=False))
    return " ".join(parts)


# -- retry ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RetryResult:
    """What ``runs retry`` did (``applied``) or would do: the nodes whose tasks were
    removed to run again and the nodes created at once (the rest follow as usual)."""

    run_id: str
    applied: bool
    reset: tuple[str, ...]
    created: tuple[str, ...]
    finished: str | None = None       # the retry finished the run at once (every node was skipped)
    duplicate: bool = False


def retry_run(shell: Shell, run_id: str, from_nodes: Sequence[str] = (), *, yes: bool,
              actor: Actor | None = None, request_id: str | None = None) -> RetryResult:
    """Run a FAILED or CANCELLED run again from ``from_nodes`` (none: from the nodes that
    failed), decided by the state machine (the RetryRun event) under the run's lock,
    with an audit row in the same transaction. Without ``yes`` the same decision is
    made and applied in a transaction that is rolled back: the result says what would
    run again. Refused: a run that is active or SUCCEEDED (:class:`Conflict`), a node
    the definition does not have, a definition version that was deleted
    (:class:`Invalid`), a run that does not exist (:class:`NotFound`)."""
    nodes = tuple(dict.fromkeys(from_nodes))
    if any(not isinstance(n, str) or not n for n in nodes):
        raise Invalid(f"nodes to retry from must be node ids, got {list(from_nodes)!r}")
    tries = [0]
    try:
        return _retry(shell, run_id, nodes, yes, actor, request_id or uuid.uuid4().hex, tries)
    except LockTimeout as exc:
        raise shell.run_locked(exc, run_id, retried=yes and tries[0] > 1) from exc


@db_retry(give_up=(LockTimeout,))
def _retry(shell: Shell, run_id: str, nodes: tuple[str, ...], yes: bool, actor: Actor | None, request: str,
           tries: list[int]) -> RetryResult:
    tries[0] += 1
    with shell.pool.connection() as conn, conn.transaction(force_rollback=not yes), \
            contextlib.nullcontext() if yes else shell.rehearsal():
        shell.operator_lock_timeout(conn)
        if yes and tries[0] > 1:
            runs.lock_runs(conn, [run_id])    # an earlier attempt still committing holds it: wait, then look
            earlier = audit.of_request(conn, request)
            if earlier:
                detail = earlier[0].detail or {}
                return RetryResult(run_id=run_id, applied=True, reset=tuple(detail.get("reset", ())),
                                   created=tuple(detail.get("created", ())), finished=detail.get("finished"),
                                   duplicate=True)
        started_on = runs.workflow_of(conn, run_id)
        if started_on is None:
            raise NotFound(f"workflow run {run_id} does not exist")
        try:
            found: DefinitionRow | None = definitions.get_version(conn, *started_on)
        except NotFound:
            found = None
        if found is None or found.deleted_at is not None:
            raise Invalid(f"run {run_id}: its definition {started_on[0]} v{started_on[1]} "
                          f"{'does not exist' if found is None else 'was deleted'}; a retry runs the version the "
                          "run started on, so it cannot be retried")
        noted = Request(id=request, operator=audit.operator_note("runs retry", actor))
        parent = runs.parent_of(conn, run_id)
        outcome = shell.handle_in(conn, run_id, partial(_retry_event, nodes, parent), request=noted)
        finished = str(outcome.finished) if outcome.finished is not None else None
        if yes:
            audit.record(conn, "runs retry", actor=actor, target=run_id, request=request,
                         counts={"reset": len(outcome.reset), "created": len(outcome.created)},
                         detail={"from": list(nodes), "reset": list(outcome.reset),
                                 "created": list(outcome.created), "finished": finished})
        return RetryResult(run_id=run_id, applied=yes, reset=outcome.reset, created=outcome.created,
                           finished=finished)


def _retry_event(nodes: tuple[str, ...], parent: ParentRow | None, now: datetime) -> RetryRun:
    if parent is None:
        return RetryRun(from_nodes=nodes, now=now)
    status, child, waits = _parent_view(parent)
    return RetryRun(from_nodes=nodes, now=now, parent_status=status, parent_child=child, parent_waits=waits)


def _parent_view(parent: ParentRow) -> tuple[str | None, str | None, bool]:
    """What the rule on a child's retry reads of its parent (core/rerun.child_left_to_parent):
    its status, the child run its node stands for now, whether that node still waits."""
    at = parent.node_created_at
    child = None if at is None else child_run_id(parent.run_id, parent.node_id, at)
    return parent.status, child, parent.node_state == TaskState.WAITING


#: The most runs one bulk retry takes.
RETRY_LIMIT = 1000


@dataclass(frozen=True, kw_only=True)
class BulkRetry:
    """What ``runs retry`` with a selection did (or would do) to each selected run."""

    retried: list[RetryResult] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)   # (run ID, why), e.g. a deleted definition
    #: (child run ID, why): SUB_WORKFLOW children whose work their parent's retry runs
    #: again (:func:`~composer_ops.core.rerun.child_left_to_parent`); not counted
    #: against the limit
    left_to_parent: list[tuple[str, str]] = field(default_factory=list)


def retry_runs(shell: Shell, chosen: Selection, from_nodes: Sequence[str] = (), *, yes: bool,
               actor: Actor | None = None, limit: int = 100) -> BulkRetry:
    """Retry every FAILED (or, when asked, CANCELLED) run ``chosen`` selects, oldest
    first, at most ``limit``: each run as :func:`retry_run` does, in a transaction of
    its own with its audit row. A run the machine refuses (a node it does not have, a
    deleted definition, a run that changed meanwhile) is reported and the others go on.
    A SUB_WORKFLOW child whose work its parent's retry runs (its parent FAILED or
    CANCELLED, or its node now standing for another child) is not retried: it is listed
    in ``left_to_parent``, not counted against ``limit``, and the selection goes on
    past it. A run whose lock another session holds past the lock wait is refused,
    naming that session, and the rest go on."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= RETRY_LIMIT:
        raise Invalid(f"limit must be an integer from 1 to {RETRY_LIMIT}, got {limit!r}")
    if not chosen.workflow_id and chosen.since is None and chosen.until is None and chosen.contains is None:
        raise Invalid("say which runs to retry: give RUN, or --where, --workflow, --since or --until")
    retryable = (RunStatus.FAILED, RunStatus.CANCELLED)
    wanted = tuple(s for s in chosen.statuses if s in retryable) if chosen.statuses else (RunStatus.FAILED,)
    if chosen.statuses and len(wanted) != len(chosen.statuses):
        raise Invalid(f"--status {','.join(chosen.statuses)}: only FAILED and CANCELLED runs can be retried")
    resolved, found = _selected(shell.pool, Selection(workflow_id=chosen.workflow_id, statuses=wanted,
                                                      since=chosen.since, until=chosen.until,
                                                      contains=chosen.contains),
                                limit=limit, oldest_first=True)
    out = BulkRetry()
    while found:
        for row in found:
            if len(out.retried) + len(out.refused) == limit:
                return out
            why = _left_to_parent(shell.pool, row.id)
            if why is not None:
                out.left_to_parent.append((row.id, why))
                continue
            try:
                out.retried.append(retry_run(shell, row.id, from_nodes, yes=yes, actor=actor))
            except (Conflict, Invalid, NotFound, BrokenRun, LockTimeout) as exc:
                # A run another session holds locked is refused, naming the holder, and the
                # selection goes on: the runs retried before it stay retried.
                out.refused.append((row.id, str(exc)))
        if len(found) < limit:
            break
        found = _next_page(shell.pool, resolved, after=found[-1].id, limit=limit)
    return out


@db_retry()
def _left_to_parent(pool: TranslatingPool, run_id: str) -> str | None:
    """Why the run is a child its parent's retry runs again, or None. A read: the retry
    itself decides under the run's lock, by the same rule."""
    with _snapshot(pool) as conn:
        parent = runs.parent_of(conn, run_id)
    if parent is None:
        return None
    status, child, waits = _parent_view(parent)
    return child_left_to_parent(run_id, parent.run_id, parent.node_id, status, child, waits=waits)


@db_retry()
def _next_page(pool: TranslatingPool, resolved: RunFilter, *, after: str, limit: int) -> list[RunListRow]:
    with _snapshot(pool) as conn:
        return runs.find_runs(conn, resolved, limit=limit, after=after, oldest_first=True)
