"""A SUB_WORKFLOW child's start, cancel and finish: applied in the deciding run's
transaction on a single server, delivered through a row on Citus.

The three apply functions (:func:`start_child`, :func:`cancel_child`,
:func:`tell_parent`) run in the transaction of the run they change and are shared by
both paths. On a single server the shell calls them inside the decision: one
transaction on one server, parent and child together. On Citus the child's run ID may
hash to another node, so the decision writes a row of ``child_deliveries`` on its own
run's node instead (:func:`write_start`, :func:`write_cancel`, :func:`write_finish`)
and every event stays on one node; :func:`deliver` then applies the row to its target
in a transaction of the target's own and deletes it.

Delivery is at least once, and each apply is idempotent: a start finds the
deterministic child ID taken and does nothing; a cancel and a finish carry the row's
request ID, which the target's history records, so a repeated delivery is recognised
(:meth:`Shell.handle_in` with ``look``) and changes nothing. The row is read, applied
(on the target's node) and deleted (on the deciding run's, if still the version
applied), each in a transaction of its own; a delivery that dies in between leaves the
row, and the next one applies it again as a no-op. A cancel written while the start is
pending replaces it and keeps the start's payload: its apply starts the child if it is
not there yet, then cancels it, so a start still committing elsewhere (its insert of
the child ID waits for it, or it waits for this one) meets a child that exists and is
cancelled.

Who delivers: the engine whose transaction wrote the rows, right after it commits
(:func:`drain`: a parent's ``start`` returns with its child started), and the
coordinator's ``children`` loop, for rows whose writer died or whose delivery failed.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any

from composer_ops.core.model import CancelRun, ChildFinished, RunStatus
from composer_ops.db.retry import db_retry
from composer_ops.engine.ids import uuid7_text
from composer_ops.engine.requests import Request
from composer_ops.engine.starts import start_in
from composer_ops.errors import BrokenRun, Conflict, Invalid, NotFound, Transient
from composer_ops.repo import deliveries, runs
from composer_ops.repo._base import Conn
from composer_ops.repo.deliveries import Delivery

if TYPE_CHECKING:
    from composer_ops.engine.shell import Shell

log = logging.getLogger(__name__)

__all__ = ["apply", "cancel_child", "deliver", "drain", "start_child", "tell_parent", "write_cancel",
           "write_finish", "write_start"]


# -- the apply functions: one run's transaction ------------------------------------

def start_child(conn: Conn, shell: Shell, *, parent: str, node_id: str, child: str, workflow: str,
                version: int | None, input: Any, request: Request) -> str | None:
    """Start ``child`` of ``parent``'s node in ``conn``'s transaction; a child that exists
    already is left as it is. Returns None, or why it could not start (its workflow was
    deleted or disabled since the parent's was deployed)."""
    if runs.workflow_of(conn, child) is not None:
        return None
    try:
        # derived: the ID is stamped with the decision's instant, which a delivery may follow by far
        start_in(conn, shell, workflow_id=workflow, version=version, input=input, run_id=child, minted=[],
                 request=request, parent=(parent, node_id), derived=True)
    except Conflict:
        return None                     # a delivery of the same row at the same time inserted it
    except (Invalid, NotFound) as exc:
        return f"did not start: {exc}"
    return None


def cancel_child(conn: Conn, shell: Shell, *, parent: str, child: str, reason: str, request: Request) -> None:
    """Cancel ``child`` in ``conn``'s transaction; one that already finished (or, on
    Citus, never started) is left as it is."""
    try:
        shell.handle_in(conn, child, lambda now: CancelRun(reason=reason, now=now), request=request,
                        look=request.look_first)
    except (Conflict, NotFound) as exc:
        log.info("child run %s of run %s not cancelled: %s", child, parent, exc,
                 extra={"action": "cancel_child", "run_id": parent})
    except BrokenRun as exc:     # odd data in the child: its parent's event goes on without it
        log.warning("child run %s of run %s not cancelled: %s", child, parent, exc,
                    extra={"action": "cancel_child", "run_id": parent})


def tell_parent(conn: Conn, shell: Shell, *, child: str, parent: str, node_id: str, status: RunStatus,
                output: Any, error: str | None, request: Request, started: bool = True) -> None:
    """Deliver a child's finish to its parent run, under the parent's lock (``started``
    False: the child could not start, ``error`` says why)."""
    shell.handle_in(conn, parent, lambda now: ChildFinished(
        node_id=node_id, child_run_id=child, status=status, output=output, error=error, started=started, now=now),
        request=request, look=request.look_first)


# -- the row path (Citus) ------------------------------------------------------------

def write_start(conn: Conn, shell: Shell, *, parent: str, node_id: str, child: str, workflow: str,
                version: int | None, input: Any, now: datetime) -> None:
    _write(conn, shell, Delivery(run_id=parent, target_run_id=child, kind="start", node_id=node_id,
                                 request=uuid7_text(), workflow_id=workflow, workflow_version=version,
                                 input=input), now)


def write_cancel(conn: Conn, shell: Shell, *, parent: str, node_id: str, child: str, reason: str,
                 now: datetime) -> None:
    _write(conn, shell, Delivery(run_id=parent, target_run_id=child, kind="cancel", node_id=node_id,
                                 request=uuid7_text(), reason=reason), now)


def write_finish(conn: Conn, shell: Shell, *, child: str, parent: str, node_id: str, status: RunStatus,
                 output: Any, error: str | None, now: datetime) -> None:
    _write(conn, shell, Delivery(run_id=child, target_run_id=parent, kind="finish", node_id=node_id,
                                 request=uuid7_text(), status=str(status), output=output, reason=error), now)


def _write(conn: Conn, shell: Shell, row: Delivery, now: datetime) -> None:
    deliveries.write(conn, row, now=now)
    shell.note_delivery(row.key)


def apply(conn: Conn, shell: Shell, row: Delivery) -> str | None:
    """Apply ``row`` to its target in ``conn``'s transaction (the target's node); None,
    or why a start could not start the child."""
    request = Request(id=row.request, look_first=True)
    if row.kind == "finish":
        try:
            tell_parent(conn, shell, child=row.run_id, parent=row.target_run_id, node_id=row.node_id,
                        status=RunStatus(str(row.status)), output=row.output, error=row.reason, request=request)
        except NotFound as exc:     # the parent was cancelled and its month dropped since
            log.info("finish of child run %s not delivered: %s", row.run_id, exc,
                     extra={"action": "tell_parent", "run_id": row.target_run_id})
        return None
    if row.workflow_id is not None:   # a start, or a cancel that replaced a start not yet applied
        why = start_child(conn, shell, parent=row.run_id, node_id=row.node_id, child=row.target_run_id,
                          workflow=row.workflow_id, version=row.workflow_version, input=row.input, request=request)
        if row.kind == "start":
            return why
        if why is not None:
            return None               # a cancelled child that cannot start: nothing to cancel
    # Its own request: the start this row may have applied recorded the row's in the child's history.
    cancel_child(conn, shell, parent=row.run_id, child=row.target_run_id, reason=row.reason or "cancelled",
                 request=Request(id=f"{row.request}/cancel", look_first=True))
    return None


def deliver(shell: Shell, key: tuple[str, str]) -> bool:
    """Apply the row ``key`` (run, target) and delete it, each in a transaction of its
    own, one connection at a time; False when the row is gone. A start that could not
    start the child fails the parent's node in the parent's transaction, which deletes
    the row. Two deliveries of one row at once both apply it, and the second changes
    nothing; a row written again meanwhile (a cancel over a start) is not deleted."""
    row = _read(shell, key)
    if row is None:
        return False
    why = _apply(shell, row)
    if why is None:
        _delete(shell, row)
    else:
        _refused(shell, row, why)
    return True


@db_retry()
def _read(shell: Shell, key: tuple[str, str]) -> Delivery | None:
    with shell.pool.connection() as conn:
        return deliveries.get(conn, *key)


@db_retry()
def _apply(shell: Shell, row: Delivery) -> str | None:
    with shell.pool.connection() as conn, conn.transaction():
        return apply(conn, shell, row)


@db_retry()
def _delete(shell: Shell, row: Delivery) -> None:
    with shell.pool.connection() as conn, conn.transaction():
        deliveries.delete(conn, row.run_id, row.target_run_id, row.request)


@db_retry()
def _refused(shell: Shell, row: Delivery, why: str) -> None:
    with shell.pool.connection() as conn, conn.transaction():
        tell_parent(conn, shell, child=row.target_run_id, parent=row.run_id, node_id=row.node_id,
                    status=RunStatus.FAILED, output=None, error=why,
                    request=Request(id=row.request, look_first=True), started=False)
        deliveries.delete(conn, row.run_id, row.target_run_id, row.request)


def drain(shell: Shell) -> int:
    """Deliver the rows this thread's committed transactions wrote (and the rows those
    deliveries write); a delivery that fails is left to the coordinator's loop. Returns
    how many were applied."""
    done = 0
    while keys := shell.take_deliveries():
        for key in keys:
            try:
                done += deliver(shell, key)
            except Exception as exc:  # the event that wrote it committed; the coordinator delivers it later
                log.warning("child delivery %s -> %s left to the coordinator: %s", *key, exc,
                            exc_info=not isinstance(exc, Transient))
    return done
