"""Operator actions the runbooks take that have no bulk command of their own: create
partition months ahead with an audit row, cancel runs named one by one, and run one
pass of the lease sweeper on the operator's behalf.

Each writes ``operator_audit`` rows naming its :class:`~composer_ops.repo.audit.Actor`
(a runbook's actor names the runbook's record) and, like the other operator actions,
finds its own audit row when a retry follows a lost COMMIT acknowledgement.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING

from composer_ops.core.actor import Actor
from composer_ops.core.model import CancelRun
from composer_ops.core.runids import validate_run_id
from composer_ops.db.retry import db_retry
from composer_ops.engine.requests import Request
from composer_ops.errors import BrokenRun, Conflict, Invalid, LockTimeout, NotFound
from composer_ops.repo import audit, partitions

if TYPE_CHECKING:
    from composer_ops.engine.engine import Engine
    from composer_ops.engine.shell import Shell

__all__ = ["MAX_LISTED", "ListedCancel", "SweepResult", "can_act", "cancel_listed", "ensure_partitions",
           "sweep_leases"]

#: The most runs :func:`cancel_listed` takes (one transaction).
MAX_LISTED = 100


def can_act(engine: Engine) -> tuple[bool, str]:
    """Whether this connection's role may take operator actions (it can write the audit
    every action writes), and the role's name."""
    with engine.pool.connection() as conn:
        return audit.can_record(conn)


def ensure_partitions(engine: Engine, months_ahead: int, *, actor: Actor) -> int:
    """``partitions ensure --months-ahead N`` with an audit row in its transaction;
    returns how many partitions were created."""
    if isinstance(months_ahead, bool) or not isinstance(months_ahead, int) or not 0 <= months_ahead <= 120:
        raise Invalid(f"months ahead must be an integer from 0 to 120, got {months_ahead!r}")
    return _ensure(engine, months_ahead, actor, uuid.uuid4().hex, [0])


@db_retry()
def _ensure(engine: Engine, months_ahead: int, actor: Actor, request: str, tries: list[int]) -> int:
    tries[0] += 1
    with engine.pool.connection() as conn, conn.transaction():
        if tries[0] > 1:
            earlier = audit.of_request(conn, request)
            if earlier:
                return int((earlier[0].counts or {}).get("created", 0))
        created = partitions.ensure(conn, months_ahead)
        audit.record(conn, "partitions ensure", actor=actor, target=f"{months_ahead} months ahead",
                     request=request, counts={"created": created})
        return created


@dataclass(frozen=True, kw_only=True)
class ListedCancel:
    """What :func:`cancel_listed` did (``applied``) or would do to each run."""

    applied: bool
    cancelled: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)    # (run ID, why): finished, missing


def cancel_listed(shell: Shell, run_ids: Sequence[str], *, reason: str, yes: bool,
                  actor: Actor | None = None, request_id: str | None = None) -> ListedCancel:
    """Cancel the runs named (at most :data:`MAX_LISTED`) through the engine's cancel
    event, each under its lock in run-ID order, in one transaction with one audit row.
    A run already finished or missing is skipped and said so. Without ``yes`` the same
    decisions are made in a transaction that is rolled back."""
    ids = sorted({validate_run_id(r) for r in run_ids})
    if len(ids) > MAX_LISTED:
        raise Invalid(f"at most {MAX_LISTED} runs at once, got {len(ids)}")
    if not isinstance(reason, str) or not reason.strip() or len(reason) > 1000:
        raise Invalid("the reason must be non-empty text of at most 1000 characters")
    tries = [0]
    try:
        return _cancel(shell, ids, reason, yes, actor, request_id or uuid.uuid4().hex, tries)
    except LockTimeout as exc:
        raise shell.run_locked(exc, retried=yes and tries[0] > 1) from exc


@db_retry(give_up=(LockTimeout,))
def _cancel(shell: Shell, ids: list[str], reason: str, yes: bool, actor: Actor | None, request: str,
            tries: list[int]) -> ListedCancel:
    tries[0] += 1
    with shell.pool.connection() as conn, conn.transaction(force_rollback=not yes), \
            contextlib.nullcontext() if yes else shell.rehearsal():
        shell.operator_lock_timeout(conn)
        if yes and tries[0] > 1:
            earlier = audit.of_request(conn, request)
            if earlier:
                detail = earlier[0].detail or {}
                return ListedCancel(applied=True, cancelled=list(detail.get("cancelled", [])),
                                    skipped=[(r, w) for r, w in detail.get("skipped", [])])
        out = ListedCancel(applied=yes)
        noted = Request(id=request, operator=audit.operator_note("runs cancel", actor))
        for run_id in ids:                   # ascending: the lock order of every bulk action
            try:
                with conn.transaction():     # a savepoint: a run refused leaves the others' cancels
                    outcome = shell.handle_in(conn, run_id, partial(_cancel_event, reason), request=noted)
            except NotFound:
                out.skipped.append((run_id, "does not exist"))
                continue
            except (Conflict, BrokenRun) as exc:     # finished; odd data no event can be decided on
                out.skipped.append((run_id, str(exc)))
                continue
            if outcome.applied:
                out.cancelled.append(run_id)
            else:
                out.skipped.append((run_id, outcome.stale or "already finished"))
        if yes:
            audit.record(conn, "runs cancel", actor=actor, target="runs " + ",".join(ids), request=request,
                         counts={"cancelled": len(out.cancelled), "skipped": len(out.skipped)},
                         detail={"cancelled": out.cancelled, "skipped": out.skipped, "reason": reason})
        return out


def _cancel_event(reason: str, now: datetime) -> CancelRun:
    return CancelRun(reason=reason, now=now)


@dataclass(frozen=True, kw_only=True)
class SweepResult:
    """One pass of the lease sweeper run by an operator."""

    leases_expired: int
    busy: int
    errors: list[str]


def sweep_leases(engine: Engine, *, actor: Actor) -> SweepResult:
    """One pass of the coordinator's lease sweeper (expired RUNNING tasks re-queued or
    failed, each event in its run's history as the coordinator writes it), then one
    audit row saying who ran it and what it did. The pass is many transactions, one per
    run, so the audit row follows them in a transaction of its own: a process that dies
    in between leaves the sweep done (what any coordinator would have done) without
    that row."""
    stats = engine.coordinator().run_once(["leases"])
    result = SweepResult(leases_expired=stats.leases_expired, busy=stats.busy, errors=list(stats.errors))
    _audit_sweep(engine, actor, result, uuid.uuid4().hex)
    return result


@db_retry()
def _audit_sweep(engine: Engine, actor: Actor, result: SweepResult, request: str) -> None:
    with engine.pool.connection() as conn, conn.transaction():
        if audit.of_request(conn, request):
            return
        audit.record(conn, "lease sweep", actor=actor, target="expired leases", request=request,
                     counts={"leases_expired": result.leases_expired, "busy": result.busy},
                     detail={"errors": result.errors})
