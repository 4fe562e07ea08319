"""Every attempt of a run's tasks, read from its history.

A task row keeps only its current attempt, so earlier attempts exist only in the run's
history: a ``claimed`` row opens an attempt and ``completed``, ``failed``,
``lease_expired`` or ``cancelled`` ends it (a run's cancel, every attempt still running;
the tasks a failure cancelled, those of the nodes its row names; ``lease_lost`` is a
note, not an end). An
operator's retry (``retried``) numbers attempts from 0 again, so each attempt carries
the retry generation it began in. :class:`HistoryRow` is declared here, in the pure
core, so the rule is typed on the row ``repo.history`` returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

__all__ = ["Attempt", "HistoryRow", "attempts", "lost_leases"]


@dataclass(frozen=True, kw_only=True)
class HistoryRow:
    """A row of a run's history (``run_history``) as the repository returns it: ``seq``
    orders a run's rows, ``at`` is the database clock of the transaction that wrote it,
    ``request`` the API call. What :func:`attempts` reads."""

    seq: int
    at: datetime
    kind: str
    node_id: str | None
    task_id: str | None
    attempt: int | None
    worker: str | None
    request: str | None
    detail: Any


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One attempt of one task: who ran it, when, and how it ended."""

    node_id: str | None
    task_id: str
    attempt: int
    worker: str | None = None          # the worker that claimed it (or whose lease expired)
    claimed_at: datetime | None = None
    ended_at: datetime | None = None
    outcome: str = "running"           # running, completed, failed, lease expired, cancelled
    error: str | None = None
    requeued: bool | None = None       # after a failure or an expiry: whether the task runs again
    lost: str | None = None            # the worker's own note that it lost (or gave up) the lease
    retry: int = 0                     # how many operator retries of the run came before it began

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def label(self) -> str:
        """``2``, or ``2 (retry 1)`` for an attempt begun after the run's first retry."""
        return str(self.attempt) if not self.retry else f"{self.attempt} (retry {self.retry})"


_ENDS = {"completed": "completed", "failed": "failed", "lease_expired": "lease expired"}


def attempts(history: Iterable[HistoryRow]) -> list[Attempt]:
    """The attempts ``history`` (one run's rows, oldest first) records, in the order
    they began."""
    found: dict[tuple[str, int], Attempt] = {}
    generation = 0
    for row in history:
        detail: dict[str, Any] = row.detail if isinstance(row.detail, dict) else {}
        if row.kind == "retried":
            generation += 1
            continue
        if row.kind == "cancelled":
            # A run's cancel ends every attempt still running; tasks cancelled as a run
            # or a MAP node failed, those of the nodes the row names.
            nodes = detail.get("nodes")
            for key, a in found.items():
                if a.outcome == "running" and (nodes is None or a.node_id in nodes):
                    found[key] = replace(a, outcome="cancelled", ended_at=row.at)
            continue
        if row.task_id is None or row.attempt is None or row.kind not in (*_ENDS, "claimed", "lease_lost"):
            continue
        key = (row.task_id, row.attempt)
        a = found.get(key) or Attempt(node_id=row.node_id, task_id=row.task_id, attempt=row.attempt,
                                      retry=generation)
        if row.kind == "claimed":
            a = replace(a, worker=row.worker, claimed_at=row.at)
        elif row.kind == "lease_lost":
            a = replace(a, lost=str(detail.get("reason") or "lease lost"), worker=a.worker or row.worker)
        else:
            error = detail.get("error")
            a = replace(a, outcome=_ENDS[row.kind], ended_at=row.at, worker=a.worker or row.worker,
                        error=None if error is None else str(error),
                        requeued=bool(detail["requeued"]) if "requeued" in detail else None)
        found[key] = a
    return list(found.values())


def lost_leases(history: Iterable[HistoryRow]) -> list[Attempt]:
    """The attempts that ended in an expired lease, each naming the worker that held it."""
    return [a for a in attempts(history) if a.outcome == "lease expired"]
