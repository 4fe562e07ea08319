"""Operator actions on runs and workers: find runs, see workers.

A selection of runs is checked whole before anything is read (:func:`selection`: a
bad status, window or ``--where`` is :class:`Invalid`); ages in the window are then
counted back from the database clock in the transaction that reads the runs.

Reads here run in one REPEATABLE READ, read-only transaction, so the figures of one
answer (a worker's state and the leases it holds) come from one snapshot and one
database clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg

from composer_ops.core.filters import RunFilter, parse_statuses, parse_where
from composer_ops.core.model import RunStatus
from composer_ops.core.spec import ID_PATTERN
from composer_ops.db.errors import Pool
from composer_ops.db.retry import db_retry
from composer_ops.errors import Invalid
from composer_ops.repo import runs, workers
from composer_ops.repo.rows import LeaseRow, RunListRow, WorkerRow

if TYPE_CHECKING:
    from composer_ops.repo.retention import Cutoff

__all__ = ["MAX_LIMIT", "Selection", "WorkerReport", "find_runs", "selection", "workers_report"]

#: The most runs one ``runs list`` returns.
MAX_LIMIT = 10_000

When = datetime | str | None


@dataclass(frozen=True, kw_only=True)
class Selection:
    """A checked selection whose window may still hold ages to count back from the
    database clock (:meth:`resolve`)."""

    workflow_id: str | None
    statuses: tuple[RunStatus, ...]
    since: datetime | Cutoff | None
    until: datetime | Cutoff | None
    contains: dict[str, Any] | None

    def resolve(self, conn: psycopg.Connection[Any]) -> RunFilter:
        return RunFilter(workflow_id=self.workflow_id, statuses=self.statuses, since=_instant(conn, self.since),
                         until=_instant(conn, self.until), contains=self.contains)


def _instant(conn: psycopg.Connection[Any], value: datetime | Cutoff | None) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return value.resolve(conn)


def _when(value: When, option: str) -> datetime | Cutoff | None:
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise Invalid(f"{option} {value.isoformat()} has no time zone; pass an aware datetime (UTC)")
        return value.astimezone(UTC)
    if not isinstance(value, str):
        raise Invalid(f"{option} must be a date, an instant or an age like 7d, got {type(value).__name__}")
    from composer_ops.repo.retention import parse_cutoff

    try:
        return parse_cutoff(value)
    except Invalid:
        raise Invalid(f"{option} {value!r} is not an ISO date (2025-01-31), an ISO instant "
                      "(2025-01-31T12:00:00Z) or an age (36h, 7d, 2w, 3 months, 1y)") from None


def selection(*, workflow: str | None = None, status: str | Sequence[str] | None = None, since: When = None,
              until: When = None, where: str | Mapping[str, Any] | None = None) -> Selection:
    """Check a selection of runs: a workflow id, statuses (``FAILED`` or
    ``failed,cancelled``), a window (``since`` inclusive, ``until`` exclusive: each an
    ISO date, an ISO instant or an age like ``7d`` counted back from the database
    clock), and ``where`` (the ``--where`` language of :mod:`composer_ops.core.filters`,
    or the JSON object the input must contain). :class:`Invalid` names what is wrong."""
    if workflow is not None and (not isinstance(workflow, str) or not ID_PATTERN.fullmatch(workflow)):
        raise Invalid(f"workflow id {workflow!r} is not a workflow id (1 to 128 of A-Z a-z 0-9 _ . -)")
    if where is None or where == "":
        contains = None
    elif isinstance(where, str):
        contains = parse_where(where)
    elif isinstance(where, Mapping):
        contains = dict(where)
    else:
        raise Invalid(f"where must be text like input.customer=42 or a JSON object, got {type(where).__name__}")
    return Selection(workflow_id=workflow, statuses=parse_statuses(status), since=_when(since, "since"),
                     until=_when(until, "until"), contains=contains)


def _check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise Invalid(f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")


@db_retry()
def find_runs(pool: Pool, chosen: Selection, *, limit: int = 50) -> tuple[RunFilter, list[RunListRow]]:
    """The runs ``chosen`` selects, newest first, at most ``limit``; with the filter as
    resolved (the window as instants by the database clock)."""
    _check_limit(limit)
    with _snapshot(pool) as conn:
        resolved = chosen.resolve(conn)
        return resolved, runs.find_runs(conn, resolved, limit=limit)


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
def _snapshot(pool: Pool) -> Iterator[psycopg.Connection[Any]]:
    with pool.connection() as conn, conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield conn


@db_retry()
def workers_report(pool: Pool, *, window_s: float | None = None) -> WorkerReport:
    """The registry judged by the database clock (:func:`repo.workers.list_workers`),
    the leases of the workers that are not live, and unregistered lease owners."""
    with _snapshot(pool) as conn:
        found = workers.list_workers(conn, window_s=window_s)
        gone = [w.id for w in found if w.state != "live" and w.running]
        return WorkerReport(workers=found, leases=workers.leases_of(conn, gone),
                            unregistered=workers.unregistered_owners(conn))
