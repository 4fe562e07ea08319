"""Operator levers on queues: list, pause, resume, set a limit (``engine.queues``,
``composer-ops queues``).

A change runs in one transaction: it locks the queue's settings row (creating it when
the queue has none), then looks for its request's audit row, then writes the settings
and one ``operator_audit`` row. A change retried after a lost COMMIT acknowledgement
(``db_retry``, same request ID) waits on that lock for an earlier attempt still
committing, then finds its audit row and returns what it did, changing nothing more.
A dry run (``yes=False``) reads the settings and says what would change.

Every claim reads its queues' settings (sql/R__claim.sql), so a pause holds from the
next claim of every worker on: at most one poll interval after the commit.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from composer_ops.core.actor import Actor
from composer_ops.core.spec import ID_PATTERN
from composer_ops.db.errors import TranslatingPool
from composer_ops.db.retry import db_retry
from composer_ops.errors import Invalid
from composer_ops.repo import audit, clock, queues
from composer_ops.repo._base import repeatable_read
from composer_ops.repo.rows import QueueRow, QueueSetting

__all__ = ["MAX_RUNNING_LIMIT", "QueueChange", "Queues", "check_queue"]

#: The largest ``max_running`` accepted (0 is no limit).
MAX_RUNNING_LIMIT = 1_000_000


@dataclass(frozen=True, kw_only=True)
class QueueChange:
    """What a pause, resume or set-limit did (``applied``) or would do."""

    queue: str
    action: str                      # "queues pause", "queues resume", "queues set-limit"
    applied: bool
    changed: bool                    # the settings differ from before
    before: dict[str, Any]           # paused, reason, max_running
    after: dict[str, Any]
    duplicate: bool = False           # an earlier attempt committed; read back from its audit row

    def to_json(self) -> dict[str, Any]:
        return {"queue": self.queue, "action": self.action, "applied": self.applied, "changed": self.changed,
                "before": self.before, "after": self.after, "replayed": self.duplicate}


def check_queue(name: object) -> str:
    if not isinstance(name, str) or not ID_PATTERN.fullmatch(name):
        raise Invalid(f"queue {name!r} is not a queue name (1 to 128 of A-Z a-z 0-9 _ . -)")
    return name


def _state(setting: QueueSetting | None) -> dict[str, Any]:
    if setting is None:
        return {"paused": False, "reason": None, "max_running": 0}
    return {"paused": setting.paused, "reason": setting.reason, "max_running": setting.max_running}


class Queues:
    """``engine.queues``: the queues' state and the operator's levers on them."""

    def __init__(self, pool: TranslatingPool) -> None:
        self._pool = pool

    @db_retry()
    def list(self) -> list[QueueRow]:
        """Every queue with a setting, a dispatch or a RUNNING task: paused or not (why,
        since when, for how long), max_running, depth, ready, oldest ready age, running."""
        with self._pool.connection() as conn, conn.transaction():
            repeatable_read(conn, read_only=True)
            return queues.overview(conn, clock.now(conn))

    @db_retry()
    def named(self, queue: str) -> bool:
        """Whether a setting, a dispatch, a running task, a worker or a deployed workflow
        names ``queue`` (else a change to it is likely a typo: the CLI warns)."""
        with self._pool.connection() as conn:
            return queues.named(conn, check_queue(queue))

    def pause(self, queue: str, *, reason: str | None = None, yes: bool = True, actor: Actor | None = None,
              request_id: str | None = None) -> QueueChange:
        """Stop every claim from taking tasks of ``queue``; its tasks stay queued. A
        ``reason`` replaces the queue's; without one, a paused queue keeps its own."""
        if reason is not None and (not isinstance(reason, str) or len(reason) > 1000):
            raise Invalid("the reason must be text of at most 1000 characters")
        wanted: dict[str, Any] = {"paused": True, **({"reason": reason} if reason else {})}
        return self._change(check_queue(queue), "queues pause", wanted, yes, actor, request_id)

    def resume(self, queue: str, *, yes: bool = True, actor: Actor | None = None,
               request_id: str | None = None) -> QueueChange:
        """Let claims take tasks of ``queue`` again."""
        return self._change(check_queue(queue), "queues resume", {"paused": False, "reason": None}, yes, actor,
                            request_id)

    def set_limit(self, queue: str, max_running: int, *, yes: bool = True, actor: Actor | None = None,
                  request_id: str | None = None) -> QueueChange:
        """At most ``max_running`` RUNNING attempts of ``queue`` at once over all workers
        (0: no limit). Attempts already running above a new, lower limit finish; no new
        one starts until the queue is under it."""
        if isinstance(max_running, bool) or not isinstance(max_running, int) \
                or not 0 <= max_running <= MAX_RUNNING_LIMIT:
            raise Invalid(f"--max-running must be an integer from 0 (no limit) to {MAX_RUNNING_LIMIT}, "
                          f"got {max_running!r}")
        return self._change(check_queue(queue), "queues set-limit", {"max_running": max_running}, yes, actor,
                            request_id)

    def _change(self, queue: str, action: str, wanted: dict[str, Any], yes: bool, actor: Actor | None,
                request_id: str | None) -> QueueChange:
        if not yes:
            with self._pool.connection() as conn, conn.transaction():
                repeatable_read(conn, read_only=True)
                found = queues.settings(conn, [queue])
            before = _state(found[0] if found else None)
            after = {**before, **wanted}
            return QueueChange(queue=queue, action=action, applied=False, changed=after != before, before=before,
                               after=after)
        return self._apply(queue, action, wanted, actor, request_id or uuid.uuid4().hex)

    @db_retry()
    def _apply(self, queue: str, action: str, wanted: dict[str, Any], actor: Actor | None,
               request: str) -> QueueChange:
        with self._pool.connection() as conn, conn.transaction():
            audit.require_record(conn, action)
            locked, created = queues.lock(conn, queue)   # lock, then look: an earlier attempt committed first
            earlier = audit.of_request(conn, request)
            if earlier:
                if created:                      # the lock made the row the earlier attempt forgot
                    queues.forget(conn, queue)
                detail = earlier[0].detail or {}
                return QueueChange(queue=queue, action=action, applied=True, changed=bool(detail.get("changed")),
                                   before=dict(detail.get("before") or {}), after=dict(detail.get("after") or {}),
                                   duplicate=True)
            now = clock.now(conn)
            before = _state(locked)
            after = {**before, **wanted}
            paused_at = None
            if after["paused"]:
                paused_at = locked.paused_at if locked.paused and locked.paused_at is not None else now
            changed = after != before
            if created and not changed:
                queues.forget(conn, queue)       # a change to nothing: no row for a queue that had none
            else:
                queues.update(conn, queue, paused=after["paused"], reason=after["reason"], paused_at=paused_at,
                              max_running=after["max_running"], now=now)
                if changed and after["max_running"]:
                    queues.hold_running(conn, queue)   # attempts started while it had no limit count too
            audit.record(conn, action, actor=actor, target=queue, request=request,
                         counts={"changed": int(changed)},
                         detail={"before": before, "after": after, "changed": changed})
            return QueueChange(queue=queue, action=action, applied=True, changed=changed, before=before, after=after)
