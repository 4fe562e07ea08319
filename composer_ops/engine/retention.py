"""The retention drop: ``composer-ops partitions drop --yes`` and the coordinator's
optional retention.

Each attempt is one transaction with ``lock_timeout`` set, retried after a jittered
backoff, so no DROP waits long enough to stall the engine. Under the partition advisory
lock it locks every month the plan would drop, then reads the plan again under those
locks and drops exactly that. Each drop is recorded with its request ID in the same
transaction; a retry takes the advisory lock before it looks for that record, so a
first attempt still committing is waited for and reported, not dropped twice.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeAlias

import psycopg

from composer_ops.core.actor import Actor
from composer_ops.core.cutoff import Cutoff
from composer_ops.core.runids import RUN_ID_MAX_AGE
from composer_ops.db import connect
from composer_ops.db.errors import TranslatingPool
from composer_ops.db.retry import backoff_delay
from composer_ops.errors import ComposerError, Invalid, LockTimeout, Transient, Unavailable
from composer_ops.repo import audit, locks, partitions, retention
from composer_ops.repo.rows import RetentionMonth

log = logging.getLogger(__name__)

Source: TypeAlias = "psycopg.Connection[Any] | TranslatingPool | str | None"

#: ``partitions drop`` exits with this when due months were kept for active runs.
BLOCKED_REASON = "has active runs"
#: ... or for finished runs whose SUB_WORKFLOW children are still active.
CHILDREN_REASON = "has live children"
BLOCKED_REASONS = (BLOCKED_REASON, CHILDREN_REASON)
#: The plan's reason (then ': <partition> holds [<from>, <to>) UTC') for a month it
#: refuses: a partition of it has bounds that are not its name's month's
#: (``composer_misaligned_bounds``), so its name says nothing of the rows it holds.
MISALIGNED_REASON = "bounds do not match its name"


def misaligned(plan: list[RetentionMonth]) -> list[RetentionMonth]:
    """The months of ``plan`` it refuses for :data:`MISALIGNED_REASON`: drop, archive and
    detach name them (exit 1) and leave them as they are."""
    return [m for m in plan if m.action == "keep" and m.reason.startswith(MISALIGNED_REASON)]


@dataclass(frozen=True, kw_only=True)
class RetentionResult:
    """What one retention request did."""

    cutoff: datetime
    plan: list[RetentionMonth]      # judged under the locks; the dropped months are in it
    dropped: list[str]              # YYYYMM, oldest first
    attempts: int
    request_id: str
    duplicate: bool = False          # an earlier attempt committed; its record was read back
    warnings: list[str] = field(default_factory=list)

    @property
    def blocked(self) -> list[RetentionMonth]:
        """Months past the cut-off kept only because runs in them (or their children) are
        still active."""
        return [m for m in self.plan if m.action == "keep" and m.reason in BLOCKED_REASONS]


class _Raced(Exception):
    """The plan changed between reading it and dropping: start the attempt over."""


def drop_due_months(source: Source, older_than: datetime | str | Cutoff, *, lock_timeout_s: float = 2.0,
                    max_attempts: int = 5, min_age: timedelta = RUN_ID_MAX_AGE,
                    request_id: str | None = None, actor: Actor | None = None) -> RetentionResult:
    """Drop every partition month the plan marks 'drop' and commit; see the module.
    A drop that dropped something writes one ``operator_audit`` row (``actor``: who
    asked) in its transaction.

    ``source``: a connection (used as is; its transaction is committed), a pool or a
    URL (a fresh connection for each attempt, so a lost connection is retried)."""
    if lock_timeout_s <= 0 or max_attempts < 1:
        raise Invalid(f"lock timeout must be > 0 and attempts >= 1, got {lock_timeout_s}s and {max_attempts}")
    request = request_id or uuid.uuid4().hex
    attempts = 0
    while True:
        attempts += 1
        try:
            with _connection(source) as conn:
                return _attempt(conn, older_than, lock_timeout_s, min_age, request, attempts, actor)
        except (_Raced, Transient) as exc:
            if attempts >= max_attempts:
                if isinstance(exc, LockTimeout):
                    holders = locks.holders_text_on(_connection(source), partitions.RUN_TABLES)
                    raise ComposerError(
                        f"could not lock the partitions to drop within {lock_timeout_s:g}s in {attempts} attempts "
                        f"({holders}); nothing was dropped, try again later") from exc
                if isinstance(exc, _Raced):
                    raise ComposerError(f"retention aborted: {exc}; nothing was dropped, try again") from exc
                raise
            if isinstance(source, psycopg.Connection) and source.closed:
                raise Unavailable(f"drop partitions: the connection was lost ({exc}); whether the drop "
                                  "committed is unknown: run it again to see") from exc
            delay = backoff_delay(attempts - 1, base=0.25, cap=4.0)
            log.warning("retention attempt %d failed (%s); retrying in %.2fs", attempts, exc, delay)
            time.sleep(delay)


@contextlib.contextmanager
def _connection(source: Source) -> Iterator[psycopg.Connection[Any]]:
    if isinstance(source, psycopg.Connection):
        yield source
    elif isinstance(source, TranslatingPool):
        with source.connection() as conn:
            yield conn
    else:
        with connect(source, application_name="composer-ops retention") as conn:
            yield conn



def _attempt(conn: psycopg.Connection[Any], older_than: datetime | str | Cutoff, lock_timeout_s: float,
             min_age: timedelta, request: str, attempts: int, actor: Actor | None) -> RetentionResult:
    with conn.transaction():
        audit.require_record(conn, "partitions drop")     # the owner's: one line naming it, not the server's
        partitions.set_lock_timeout(conn, lock_timeout_s)
        # The advisory lock first: an earlier attempt still committing holds it, and its
        # record is visible to the statement after the lock is granted.
        retention.lock_partitions(conn)
        earlier = retention.recorded(conn, request)
        if earlier is not None:
            cutoff, done = earlier
            current = retention.plan(conn, cutoff, min_age=min_age).months
            return RetentionResult(cutoff=cutoff, plan=sorted([*done, *current], key=lambda m: m.month),
                                   dropped=[m.month for m in done], attempts=attempts, request_id=request,
                                   duplicate=True)
        cutoff = retention.resolve(conn, older_than)
        retention.lock_months(conn, retention.plan(conn, cutoff, min_age=min_age).due)
        judged = retention.plan(conn, cutoff, min_age=min_age)
        planned = judged.due
        dropped = retention.drop(conn, cutoff, min_age=min_age)
        if dropped != [m.month for m in planned]:
            raise _Raced(f"the plan said drop {[m.month for m in planned]} but the drop returned {dropped}")
        retention.record(conn, request, cutoff, planned)
        if planned:
            audit.record(conn, "partitions drop", actor=actor, target=",".join(dropped), request=request,
                         counts={"months": len(planned), audit.ESTIMATED_ROWS: sum(m.rows for m in planned),
                                 "bytes": sum(m.bytes for m in planned)},
                         detail={"cutoff": cutoff.isoformat(),
                                 "partitions": [p for m in planned for p in m.partitions]})
    return RetentionResult(cutoff=cutoff, plan=judged.months, dropped=dropped, attempts=attempts, request_id=request)
