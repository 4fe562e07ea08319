"""``Engine``: the application developer's entry point (deploy, start, signal, cancel,
inspect) and the worker's side of a task (claim, complete, fail, heartbeat)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from composer_ops.core.actor import Actor
from composer_ops.core.children import child_cycle, children_of
from composer_ops.core.model import TERMINAL_RUN_STATUSES, CancelRun, SignalReceived, TaskCompleted, TaskFailed, TaskRef
from composer_ops.core.runids import validate_run_id
from composer_ops.core.selection import selection
from composer_ops.core.spec import ID_PATTERN, WorkflowSpec, parse_spec
from composer_ops.db import make_pool, resolve_url
from composer_ops.db.errors import TranslatingPool
from composer_ops.db.migrate import migrate as run_migrations
from composer_ops.db.retry import DEFAULT_ATTEMPTS, db_retry
from composer_ops.engine import admin, childrows
from composer_ops.engine.admin import WorkerReport
from composer_ops.engine.ids import uuid7_text
from composer_ops.engine.jsonvalues import check_json
from composer_ops.engine.queues import Queues
from composer_ops.engine.requests import Request, key_request
from composer_ops.engine.schedules import Schedules
from composer_ops.engine.shell import Outcome, Shell
from composer_ops.engine.starts import StaleDefinition, start_committed
from composer_ops.errors import Conflict, Invalid, LockTimeout, NotDelegated, NotFound
from composer_ops.repo import (
    audit,
    citus,
    clock,
    definitions,
    history,
    outbox,
    partitions,
    runs,
    tasks,
    webhooks,
    workers,
)
from composer_ops.repo._base import Conn
from composer_ops.repo.outbox import ClaimAsk, ClaimNext
from composer_ops.repo.rows import Claim, DeletedRun, HistoryEntry, PartitionRow, RunListRow, RunView

if TYPE_CHECKING:
    from composer_ops.engine.coordinator import Coordinator

log = logging.getLogger(__name__)

#: How long a Citus engine keeps the stream keys (one per node holding outbox shards)
#: before it finds them again: the delay after which a node added or rebalanced is claimed from.
STREAM_KEYS_TTL_S = 60.0


#: How long, by default, one call of an engine waits for the database in all (:meth:`Engine.connect`).
DEFAULT_TIMEOUT_S = 30.0
#: The attempts of one call on a transient error (``db_retry``'s default), over which
#: ``timeout_s`` is shared.
CALL_ATTEMPTS = DEFAULT_ATTEMPTS
POOL_SIZE_ENV = "COMPOSER_POOL_SIZE"


def _positive_seconds(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def _pool_size(size: object) -> int:
    """``size``, else ``COMPOSER_POOL_SIZE``, else 10: a positive integer, or :class:`Invalid`."""
    if size is None:
        text = os.environ.get(POOL_SIZE_ENV, "10").strip()
        if not text.isdigit() or int(text) < 1:
            raise Invalid(f"{POOL_SIZE_ENV} must be a positive integer, got {text!r}")
        return int(text)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise Invalid(f"pool_size must be a positive integer, got {size!r}")
    return size


class Engine:
    """A connection pool plus the shell: deploy, start, signal, cancel, inspect.

    Thread-safe; one per process is enough. Every error it raises is a ComposerError.
    """

    def __init__(self, pool: TranslatingPool, url: str, *, lock_wait_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.pool = pool
        self.url = url
        self.shell = Shell(pool)
        self.shell.operator_lock_wait_s = lock_wait_s
        self.schedules = Schedules(self)
        self._stream_keys: list[str] = []
        self._stream_keys_at = 0.0
        self._stream_next = 0
        self._undelegated: set[str] = set()     # stream keys whose node call Citus did not delegate
        self._undelegated_lock = threading.Lock()

    def _on_citus(self, conn: Any) -> bool:
        """Whether the database is a Citus coordinator (:meth:`Shell.on_citus`, asked
        once; on Citus the claim is :func:`composer_ops.repo.citus.claim`)."""
        return self.shell.on_citus(conn)

    @classmethod
    def connect(cls, url: str | None = None, *, pool_size: int | None = None,
                application_name: str = "composer-engine", connect_wait_s: float = 0.0,
                timeout_s: float = DEFAULT_TIMEOUT_S, lock_wait_s: float | None = None) -> Engine:
        """Open the pool on ``url``, else ``COMPOSER_DATABASE_URL``, else the embedded
        server, which is started if it is not running (:func:`~composer_ops.db.resolve_url`;
        code that only reads and must never start a server passes
        :func:`~composer_ops.db.find_url`'s answer instead).

        An unreachable server raises :class:`Unavailable` at once, unless
        ``connect_wait_s`` > 0: then a server that is down, starting or shutting down is
        waited for that long (what a long-running worker or coordinator wants when it
        starts before, or during a restart of, the database).

        ``timeout_s`` bounds how long one call waits for the database once connected:
        a call retries a transient error up to :data:`CALL_ATTEMPTS` times, each
        attempt waiting at most ``timeout_s / CALL_ATTEMPTS`` for a pooled connection,
        so a call on a server that went down raises :class:`Transient` after about
        ``timeout_s`` seconds (plus under 2 s of backoff between attempts).
        An operator's call on existing runs (:meth:`signal`, :meth:`cancel`,
        :meth:`retry`, :meth:`cancel_runs`) waits at most ``lock_wait_s`` (else
        ``timeout_s``) for a run's lock, then raises :class:`LockTimeout` naming the run
        and the session holding it; a worker's :meth:`complete` and :meth:`fail` wait
        as long as it takes (the lease and its fencing cover them).
        ``pool_size`` (else ``COMPOSER_POOL_SIZE``, else 10) is the most connections
        the pool opens. A URL libpq cannot parse, or a size or time out of range, is
        :class:`Invalid`."""
        if not _positive_seconds(timeout_s):
            raise Invalid(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if lock_wait_s is not None and not _positive_seconds(lock_wait_s):
            raise Invalid(f"lock_wait_s must be a positive number of seconds, got {lock_wait_s!r}")
        size = _pool_size(pool_size)
        target = resolve_url(url)
        pool = make_pool(target, min_size=1, max_size=size, application_name=application_name,
                         timeout=timeout_s / CALL_ATTEMPTS, wait_s=connect_wait_s)
        return cls(pool, target, lock_wait_s=timeout_s if lock_wait_s is None else lock_wait_s)

    def close(self) -> None:
        """Close the pool; a call made afterwards raises a :class:`ComposerError` (not
        :class:`Unavailable`: the caller's bug, which no retry cures)."""
        self.pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- schema and definitions ---------------------------------------------

    def migrate(self, *, citus: bool | None = None) -> list[str]:
        """Apply pending migrations; returns the files applied. A Citus database is
        detected (``citus=True`` requires one): see :func:`composer_ops.db.migrate.migrate`."""
        return [m.filename for m in run_migrations(self.url, citus=citus)]

    @db_retry()
    def deploy(self, spec: Mapping[str, Any], *, created_by: str = "composer-ops") -> tuple[str, int]:
        """Validate ``spec``, store it as version last+1, deploy it and un-deploy the
        others, in one transaction. Returns ``(workflow_id, version)``."""
        if not isinstance(spec, Mapping):
            raise Invalid(f"a workflow definition is a JSON object, got {type(spec).__name__}")
        # The generic JSON checks first (size, depth, text PostgreSQL can store): a YAML
        # alias bomb or a 100 MB config must not reach the validator or the table.
        check_json(dict(spec), "workflow definition")
        parsed = parse_spec(spec)
        with self.pool.connection() as conn, conn.transaction():
            self._check_children(conn, parsed)
            version = definitions.insert_version(conn, workflow_id=parsed.id, name=parsed.name,
                                                 spec=parsed.to_json(), created_by=created_by,
                                                 webhook_url=parsed.webhook_url)
            definitions.deploy(conn, parsed.id, version)
        log.info("deployed %s v%d", parsed.id, version, extra={"action": "deploy", "workflow_id": parsed.id})
        return parsed.id, version

    def _check_children(self, conn: Conn, parsed: WorkflowSpec) -> None:
        """Refuse a definition whose SUB_WORKFLOW nodes name a workflow (or version) that
        does not exist, or whose children lead back to it: one line naming the node."""
        for node_id, workflow, version in children_of(parsed):
            if workflow == parsed.id:
                raise Invalid(f'node "{node_id}": SUB_WORKFLOW cycle "{parsed.id}" -> "{workflow}"')
            try:
                self._child_spec(conn, workflow, version)
            except NotFound as exc:
                raise Invalid(f'node "{node_id}": unknown child workflow: {exc}') from None
        cycle = child_cycle(parsed, lambda wf, v: self._child_spec(conn, wf, v))
        if cycle is not None:
            raise Invalid(cycle)

    def _child_spec(self, conn: Conn, workflow: str, version: int | None) -> WorkflowSpec:
        row = (definitions.get_deployed(conn, workflow) if version is None
               else definitions.get_version(conn, workflow, version))
        return self.shell.definition(conn, row.id, row.version).spec

    def set_enabled(self, workflow_id: str, enabled: bool) -> None:
        _check_workflow_id(workflow_id)
        with self.pool.connection() as conn, conn.transaction():
            definitions.set_enabled(conn, workflow_id, enabled)

    def delete(self, workflow_id: str) -> None:
        """Soft-delete every version: new runs are refused, started runs finish."""
        _check_workflow_id(workflow_id)
        with self.pool.connection() as conn, conn.transaction():
            definitions.soft_delete(conn, workflow_id)

    # -- runs -----------------------------------------------------------------

    def start(self, workflow_id: str, input: Any = None, version: int | None = None,
              run_id: str | None = None) -> str:
        """Start a run of the deployed (or the given) version; returns the run ID.

        A client-supplied ``run_id`` must be a canonical lowercase UUIDv7 minted within
        the last hour (and at most 5 minutes ahead) by the database clock, in a month
        that has a partition. Starting the same run ID twice is a Conflict.
        """
        _check_workflow_id(workflow_id)
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
            raise Invalid(f"version must be a positive integer, got {version!r}")
        check_json(input, "input")
        if run_id is not None:
            validate_run_id(run_id)  # the format, before touching the database
        try:
            started = self._start(workflow_id, input, version, run_id, [], Request())
        except BaseException:
            self.shell.take_deliveries()     # whatever committed of them, the coordinator's loop delivers
            raise
        childrows.drain(self.shell)
        return started

    @db_retry()
    def _start(self, workflow_id: str, input: Any, version: int | None, client_id: str | None,
               minted: list[str], request: Request) -> str:
        # The run ID (minted or the client's) and the request are kept across retries:
        # a retry whose earlier attempt committed finds the run's 'started' row of this
        # request and returns the run, never a second run and never a Conflict.
        look = request.attempt()
        if look and minted + ([client_id] if client_id else []):
            started = self._started_by(minted[0] if minted else str(client_id), request)
            if started is not None:
                return started
        for refresh in (False, True):
            with self.pool.connection() as conn:
                try:
                    run_id, used = start_committed(conn, self.shell, workflow_id=workflow_id, version=version,
                                                   input=input, run_id=client_id, minted=minted, request=request,
                                                   refresh=refresh)
                    break
                except StaleDefinition:
                    continue
                except Conflict:
                    # An earlier attempt still finishing on the server when this one looked
                    # (its connection lost, its COMMIT not yet processed) held the run ID's
                    # insert until it committed: look again now that it has.
                    again = minted[0] if minted else client_id
                    if look and again is not None and self._started_by(again, request) is not None:
                        return again
                    raise
        else:
            raise Conflict(f"workflow {workflow_id!r} changed while a run was starting; try again")
        log.info("started run %s of %s v%d", run_id, workflow_id, used,
                 extra={"action": "start_run", "run_id": run_id})
        return run_id

    def _started_by(self, run_id: str, request: Request) -> str | None:
        """``run_id`` when ``request`` started that run (an attempt whose acknowledgement was lost)."""
        with self.pool.connection() as conn:
            found = history.of_request(conn, run_id, request.id)
        if not found:
            return None
        log.info("run %s was started by an earlier attempt whose commit was not acknowledged", run_id,
                 extra={"action": "start_run", "run_id": run_id})
        return run_id

    def signal(self, run_id: str, name: str, payload: Any = None, key: str | None = None) -> Outcome:
        """Deliver a signal: it resolves the earliest-created node waiting for ``name``,
        or is buffered. A finished run is a Conflict; an unknown one NotFound; a signal
        that arrives after the waiter's timeout (by the database clock) finds the node
        timed out, and is a Conflict if that timeout finished the run.

        ``key`` is the caller's idempotency key: every call with the same key (on this
        run) after the first returns the first call's outcome (``duplicate``) and
        resolves nothing more."""
        validate_run_id(run_id)
        if not isinstance(name, str) or not name.strip() or len(name) > 200 or "\x00" in name:
            raise Invalid(f"signal name must be a non-empty string of at most 200 characters, got {name!r}")
        if key is not None and (not isinstance(key, str) or not key.strip() or len(key) > 200
                                or not key.isprintable()):
            raise Invalid(f"signal key must be a non-empty printable string of at most 200 characters, got {key!r}")
        check_json(payload, "payload")
        outcome = self.shell.handle_operator(run_id, lambda now: SignalReceived(name=name, payload=payload,
                                                                                now=now),
                                             request=key_request(key) if key is not None else None)
        if outcome.refused:
            raise Conflict(outcome.refused)
        return outcome

    def cancel(self, run_id: str, reason: str = "cancelled") -> Outcome:
        """Cancel a run and its active tasks; late results for them are stale."""
        validate_run_id(run_id)
        return self.shell.handle_operator(run_id, lambda now: CancelRun(reason=reason, now=now))

    def delete_run(self, run_id: str, *, actor: Actor | None = None) -> DeletedRun:
        """Soft-delete a finished run: it disappears from ``get_run``, the loops, the
        claim and the reports, and its rows leave with its month (retention). A run
        that is still active is a Conflict (cancel it first); deleting a deleted run
        changes nothing and says so (``already``). A pending webhook delivery of the
        run is given up. The delete is recorded in the run's history under the call's
        request (naming the action and ``actor``), so a retry whose lost attempt
        committed returns what that attempt did, and in an ``operator_audit`` row
        (``actor``: who asked) with the same request."""
        validate_run_id(run_id)
        request = Request()
        try:
            return self._delete_run(run_id, request, actor)
        except LockTimeout as exc:
            raise self.shell.run_locked(exc, run_id, retried=request.tries > 1) from exc

    @db_retry(give_up=(LockTimeout,))
    def _delete_run(self, run_id: str, request: Request, actor: Actor | None) -> DeletedRun:
        look = request.attempt()
        with self.pool.connection() as conn, conn.transaction():
            self.shell.operator_lock_timeout(conn)
            found = runs.lock_for_delete(conn, run_id)
            if found is None:
                raise NotFound(f"workflow run {run_id} does not exist")
            status, deleted_at = found
            if deleted_at is not None:
                earlier = history.of_request(conn, run_id, request.id) if look else []
                detail = earlier[0].detail if earlier else {}
                return DeletedRun(run_id=run_id, status=status, deleted_at=deleted_at, already=not earlier,
                                  webhooks_given_up=detail.get("webhooks_given_up", 0),
                                  dispatches_dropped=detail.get("dispatches_dropped", 0))
            if status not in TERMINAL_RUN_STATUSES:
                raise Conflict(f"run {run_id} is {status}: only finished runs can be deleted (cancel it first)")
            deleted_at = runs.soft_delete(conn, run_id)
            dropped = outbox.delete_for_run(conn, run_id)
            given_up = webhooks.give_up_for_run(conn, run_id, "run deleted before its webhook was delivered")
            history.record(conn, run_id, request.id, [HistoryEntry(
                kind="deleted", detail={"status": status, "webhooks_given_up": given_up,
                                        "dispatches_dropped": dropped,
                                        "operator": audit.operator_note("runs delete", actor)})], now=deleted_at)
            audit.record(conn, "runs delete", actor=actor, target=run_id, request=request.id,
                         counts={"runs": 1, "webhooks_given_up": given_up, "dispatches_dropped": dropped},
                         detail={"status": status})
        log.info("deleted run %s (%s)", run_id, status, extra={"action": "delete_run", "run_id": run_id})
        return DeletedRun(run_id=run_id, status=status, deleted_at=deleted_at, already=False,
                          webhooks_given_up=given_up, dispatches_dropped=dropped)

    @db_retry()
    def get_run(self, run_id: str) -> RunView:
        """The run, its output or error, and every task (node_id, state, attempt, output, error)."""
        validate_run_id(run_id)
        with self.pool.connection() as conn:
            return runs.get_run(conn, run_id)

    # -- partitions ---------------------------------------------------------------

    @db_retry()
    def ensure_partitions(self, months_ahead: int = 3) -> int:
        """Create this UTC month's partitions of the run-scoped tables and
        ``months_ahead`` more (idempotent); returns how many were created."""
        if isinstance(months_ahead, bool) or not isinstance(months_ahead, int) or months_ahead < 0:
            raise Invalid(f"months ahead must be an integer, 0 or more, got {months_ahead!r}")
        with self.pool.connection() as conn, conn.transaction():
            return partitions.ensure(conn, months_ahead)

    @db_retry()
    def list_partitions(self) -> list[PartitionRow]:
        """Every partition of the run-scoped tables with its month and declared bounds."""
        with self.pool.connection() as conn:
            return partitions.list_partitions(conn)

    def coordinator(self, **options: Any) -> Coordinator:
        from composer_ops.engine.coordinator import Coordinator

        return Coordinator(self, **options)

    # -- the worker's side ----------------------------------------------------

    def claim(self, queues: Sequence[str], owner: str, limit: int, task_names: Sequence[str] | None = None,
              *, wake: str | None = None, room: int | None = None, seen: int | None = None,
              busy: Sequence[str] = (), woken: bool = False) -> list[Claim]:
        """Claim up to ``limit`` tasks for ``owner``: one statement, its own transaction
        (autocommit: no BEGIN/COMMIT round trips around it); on Citus a transaction of
        three round trips (:func:`composer_ops.repo.citus.claim`). Each claimed task's
        history records the claim's ID; a retry after a lost acknowledgement first waits
        for the lost attempt to finish on the server (the claim's advisory lock), then
        returns the tasks it took, which ``owner`` still holds. A worker passes
        ``wake``, the channel it listens on, ``room``, the tasks it has room for
        (default ``limit``), and ``seen``, the total of wake-ups handed to it that it has
        taken up (the payloads of its channel): on a single server, the claim registers
        it to be woken there by dispatches for the room it has left (on Citus no claim
        registers, and every dispatch notifies the shared channel). ``busy``: the runs
        ``owner`` has tasks of in flight; on a single server their ready tasks are taken
        after other runs' of the same priority, so its slots do not wait for each other's
        run lock. ``woken``: the worker claims because it was woken (its own wake-ups, or
        told); with ``wake``, on a single server, it then leaves tasks a dispatch handed
        to another registered worker with wake-ups still to take up to that worker, for
        their first second ready (a poll, ``woken`` false, takes any). A ``limit`` or
        ``room`` below 1, or one string where a list is taken, is :class:`Invalid`,
        refused before any round trip."""
        return self._claim(self.next_claim(queues, owner, limit, task_names, wake=wake, room=room, seen=seen,
                                           busy=busy, woken=woken), Request())

    @property
    def claims_with_events(self) -> bool:
        """Whether ``claim_next`` (:meth:`complete`, :meth:`fail`) is made: on a single
        server, once this engine knows it is one (after its first claim or event)."""
        return self.shell.known_single_server

    def next_claim(self, queues: Sequence[str], owner: str, limit: int, task_names: Sequence[str] | None = None,
                   *, wake: str | None = None, room: int | None = None, seen: int | None = None,
                   busy: Sequence[str] = (), woken: bool = False) -> ClaimAsk:
        """The claim :meth:`claim` makes with these arguments, under an ID of its own, not
        made: what :meth:`complete` and :meth:`fail` take as ``claim_next``. A ``limit`` or
        ``room`` below 1, or one string where a list is taken (``queues``, ``task_names``,
        ``busy``), is :class:`Invalid`."""
        for name, value in (("limit", limit), ("room", room)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise Invalid(f"claim {name} must be an integer of at least 1, got {value!r}")
        for name, names in (("queues", queues), ("task_names", task_names), ("busy", busy)):
            _check_names(f"claim {name}", names)
        return ClaimAsk(queues=tuple(queues), owner=owner, limit=limit, claim_id=uuid7_text(),
                        task_names=None if task_names is None else tuple(task_names), wake=wake, room=room,
                        seen=seen, busy=tuple(busy), woken=woken)

    @db_retry()
    def _claim(self, ask: ClaimAsk, request: Request) -> list[Claim]:
        look = request.attempt()
        queues, owner, limit, task_names = ask.queues, ask.owner, ask.limit, ask.task_names
        with self.pool.connection() as conn:
            on_citus = self._on_citus(conn)
            if on_citus:
                if look:
                    return self._claim_streams_again(conn, queues, owner, limit, task_names, ask.claim_id)
                return self._claim_streams(conn, queues, owner, limit, task_names, ask.claim_id)
            if not look:
                return outbox.claim_sending(conn, ask)()
            with conn.transaction():
                # Lock, then look: the attempt retried may still be executing or
                # committing on the server; it holds this lock until it is done.
                outbox.lock_claim(conn, ask.claim_id)
                earlier = outbox.claimed_by(conn, owner, ask.claim_id)
                # An earlier attempt whose statement has not reached the server yet
                # holds no lock: the fence, committed with this attempt, makes it
                # claim nothing when it does (after this attempt's own claim below,
                # which the fence must not stop).
                if earlier:
                    outbox.fence_claim(conn, ask.claim_id)
                    log.info("claim %s by %s was committed before its acknowledgement was lost: %d task(s)",
                             ask.claim_id, owner, len(earlier), extra={"action": "claim"})
                    return earlier
                claims = outbox.claim_sending(conn, ask)()
                outbox.fence_claim(conn, ask.claim_id)
                return claims

    def _keys(self, conn: Any, *, fresh: bool = False) -> list[str]:
        """The stream keys, one per node (:func:`citus.stream_keys`), found again every
        :data:`STREAM_KEYS_TTL_S` (or now, with ``fresh``): after a node is added or shards
        are moved, each node holding outbox shards gets its key within that time (a node
        without one would have its dispatches claimed by nobody)."""
        if fresh or not self._stream_keys or time.monotonic() - self._stream_keys_at > STREAM_KEYS_TTL_S:
            self._stream_keys = citus.stream_keys(conn)
            self._stream_keys_at = time.monotonic()
        return self._stream_keys

    def stream_keys(self, conn: Any, *, fresh: bool = False) -> list[str]:
        """The stream keys the claims use, one per worker node (Citus only): the
        coordinator's node scans reach the nodes with them too."""
        return self._keys(conn, fresh=fresh)

    def _claim_streams_again(self, conn: Any, queues: Sequence[str], owner: str, limit: int,
                             task_names: Sequence[str] | None, claim_id: str) -> list[Claim]:
        """On Citus, a claim retried: the lost attempt ran node by node, each call under
        its node's lock. Lock and fence the ID on every node (an attempt still running
        there is waited for, one arriving later claims nothing), then on the
        coordinator (its flow-controlled claim); only then look, over the nodes, for the
        tasks the ID took that ``owner`` still holds, and return them. When it took
        none, claim under the same ID, past the fences (``retry``)."""
        for key in self._keys(conn):
            citus.claim_on_node(conn, key, queues, owner, 0, task_names, claim_id=claim_id, retry=True)
        with conn.transaction():
            outbox.lock_claim(conn, claim_id)
            outbox.fence_claim(conn, claim_id)
            earlier = outbox.claimed_by(conn, owner, claim_id)
        if earlier:
            log.info("claim %s by %s was committed before its acknowledgement was lost: %d task(s)",
                     claim_id, owner, len(earlier), extra={"action": "claim"})
            return earlier
        return self._claim_streams(conn, queues, owner, limit, task_names, claim_id, retry=True)

    def _claim_streams(self, conn: Any, queues: Sequence[str], owner: str, limit: int,
                       task_names: Sequence[str] | None, claim_id: str, *, retry: bool = False) -> list[Claim]:
        """On Citus: claim node by node (:func:`citus.claim_on_node`), starting at the
        node after the one this engine started at last time, until ``limit`` is reached
        or every node was asked once. A node call Citus did not delegate
        (:class:`NotDelegated`: the node's metadata not synced, say) is logged, once until
        it is delegated again, and that node's tasks are left to the coordinator's claim
        over every shard (:func:`citus.claim`), as rows under a limit are."""
        keys = self._keys(conn)
        self._stream_next = (self._stream_next + 1) % max(1, len(keys))
        claims: list[Claim] = []
        flow = False
        for i in range(len(keys)):
            key = keys[(self._stream_next + i) % len(keys)]
            try:
                got, limited = citus.claim_on_node(conn, key, queues, owner, limit - len(claims), task_names,
                                                   claim_id=claim_id, retry=retry)
            except NotDelegated as exc:
                self._not_delegated(key, exc)
                flow = True
                continue
            if key in self._undelegated:
                self._not_delegated(key, None)
            claims += got
            flow = flow or limited
            if len(claims) >= limit:
                break
        if flow and len(claims) < limit:
            # Rows under a limit: the coordinator's claim, with the flow tables there.
            with conn.transaction():
                claims += citus.claim(conn, queues, owner, limit - len(claims), task_names=task_names,
                                      claim_id=claim_id, retry=retry)
        return claims

    def _not_delegated(self, key: str, exc: NotDelegated | None) -> None:
        """Note that the node call of stream ``key`` was not delegated (``exc``) or is
        again (None): logged at each change only, not at every claim."""
        with self._undelegated_lock:
            if exc is not None and key not in self._undelegated:
                self._undelegated.add(key)
                log.error("claim: the node call of stream key %s was not delegated to its worker node; that node's "
                          "tasks are claimed through the coordinator until it is: %s", key, exc)
            elif exc is None and key in self._undelegated:
                self._undelegated.discard(key)
                log.info("claim: the node call of stream key %s is delegated to its worker node again", key)

    @db_retry()
    def wakeups_handed(self, owner: str) -> int:
        """The total of wake-ups handed to worker ``owner`` so far (``task_waiters.promised``;
        0 when it is not registered): what a worker reads as it starts, since a
        registration under its ID may be a previous process's."""
        with self.pool.connection() as conn:
            return outbox.promised(conn, owner)

    @db_retry()
    def register_idle(self, queues: Sequence[str], owner: str, task_names: Sequence[str] | None, *, wake: str,
                      room: int, seen: int) -> bool:
        """Register ``owner`` to be woken on ``wake`` for ``room`` tasks, as its claims do
        (:func:`composer_ops.repo.outbox.register`); idempotent. False on Citus, where no
        claim registers (nor wakes its worker for tasks it left): nothing is written."""
        _check_names("register_idle queues", queues)
        _check_names("register_idle task_names", task_names)
        with self.pool.connection() as conn:
            if self._on_citus(conn):
                return False
            outbox.register(conn, queues, owner, task_names, wake=wake, room=room, seen=seen)
            return True

    def unregister_idle(self, owner: str, *, seen: int, told: bool) -> bool:
        """``owner`` (a worker stopping) is woken for tasks no more, and what it was
        woken for and had not claimed is passed on to the other workers
        (:func:`composer_ops.repo.outbox.unregister`); idempotent. False on Citus, where
        no claim registers, or when nothing was passed on. One attempt, not retried: a
        stopping worker does not wait on a database that is down
        (:meth:`worker_stopped` unregisters too)."""
        with self.pool.connection() as conn:
            if self._on_citus(conn):
                return False
            return outbox.unregister(conn, owner, seen=seen, told=told)

    def complete(self, claim: Claim, output: Any, *, claim_next: ClaimNext | None = None) -> Outcome:
        """Record ``claim``'s task as completed with ``output``. ``claim_next``
        (:meth:`next_claim`): claim the worker's next tasks in the same transaction, in
        the round trip of the completion's write and COMMIT; the tasks taken are
        ``Outcome.claimed`` (none when the completion was not one write, or on Citus:
        the worker claims apart then). An ``output`` that is not a storable JSON document
        (:func:`~composer_ops.engine.jsonvalues.check_json`: over 8 MiB, not JSON) is
        :class:`Invalid` and changes nothing; a :class:`Worker` turns its handler's into
        the attempt's failure first."""
        check_json(output, "output")
        ref = _task_ref(claim)
        return self.shell.handle(claim.run_id, lambda now: TaskCompleted(ref=ref, output=output, now=now),
                                 claim_next=claim_next)

    def fail(self, claim: Claim, error: str, *, retryable: bool = True, claim_next: ClaimNext | None = None) -> Outcome:
        """Record ``claim``'s attempt as failed with ``error`` (re-queued when
        ``retryable`` and its node's retry policy allows). ``claim_next``: as
        :meth:`complete` says."""
        ref = _task_ref(claim)
        return self.shell.handle(claim.run_id,
                                 lambda now: TaskFailed(ref=ref, error=error, retryable=retryable, now=now),
                                 claim_next=claim_next)

    @db_retry(max_attempts=3)
    def heartbeat(self, claim: Claim) -> datetime | None:
        """Extend the claim's lease; None when the lease is lost. Idempotent as it is: a
        retry after a lost acknowledgement finds the lease it extended still held, and
        extends it again from the database clock."""
        with self.pool.connection() as conn, conn.transaction():
            return tasks.heartbeat(conn, _task_ref(claim), claim.lease_owner, claim.lease_s)

    @db_retry(max_attempts=2)
    def end_lease(self, claim: Claim) -> bool:
        """End the claim's live lease now (by the database clock), so the lease sweeper
        re-queues the attempt at its next pass, as for any lapsed lease: for an attempt
        its worker gives up without starting it. False when the lease was lost already
        (as a retry after a lost acknowledgement finds it: it changes nothing then)."""
        with self.pool.connection() as conn, conn.transaction():
            return tasks.heartbeat(conn, _task_ref(claim), claim.lease_owner, 0) is not None

    def lease_lost(self, claim: Claim, reason: str) -> None:
        """Record in the run's history that ``claim``'s worker found its lease lost (or
        gave the attempt up, ``reason`` says which) and dropped its result."""
        self._note(claim.run_id, HistoryEntry(kind="lease_lost", node_id=claim.node_id, task_id=claim.task_id,
                                              attempt=claim.attempt, worker=claim.lease_owner,
                                              detail={"reason": reason}), Request())

    @db_retry(max_attempts=2)   # a worker records on its way out, often because the database failed
    def _note(self, run_id: str, entry: HistoryEntry, request: Request) -> None:
        look = request.attempt()
        with self.pool.connection() as conn, conn.transaction():
            if look and history.of_request(conn, run_id, request.id):
                return
            history.record(conn, run_id, request.id, [entry], now=clock.now(conn))

    # -- the workers registry ---------------------------------------------------

    @db_retry(max_attempts=3)
    def register_worker(self, worker_id: str, *, host: str, pid: int, queues: Sequence[str], concurrency: int,
                        heartbeat_s: float) -> None:
        """Record a worker that starts serving ``queues`` (``composer-ops workers list``)."""
        _check_names("register_worker queues", queues)
        with self.pool.connection() as conn:
            workers.register(conn, worker_id, host=host, pid=pid, queues=queues, concurrency=concurrency,
                             heartbeat_s=heartbeat_s)

    @db_retry(max_attempts=3)
    def worker_alive(self, worker_id: str) -> bool:
        """Refresh a registered worker's last sign of life; False if it is not registered."""
        with self.pool.connection() as conn:
            return workers.beat(conn, worker_id)

    @db_retry(max_attempts=3)
    def worker_stopped(self, worker_id: str) -> None:
        """Record that a worker stopped cleanly; its registration as a waiter goes too,
        if a claim under way as it unregistered wrote it again, and what it was handed
        and did not take up is told to the others (:func:`outbox.unregister`)."""
        with self.pool.connection() as conn:
            if not self._on_citus(conn):
                outbox.unregister(conn, worker_id, seen=None, told=False)
            workers.stopped(conn, worker_id)

    def find_runs(self, *, workflow: str | None = None, status: str | Sequence[str] | None = None,
                  since: datetime | str | None = None, until: datetime | str | None = None,
                  where: str | Mapping[str, Any] | None = None, limit: int = 50) -> list[RunListRow]:
        """Runs of ``workflow`` with ``status``, created in ``[since, until)`` (ISO dates,
        instants, or ages like ``7d`` counted back from the database clock), whose input
        contains ``where`` (``"input.customer=42"``, or a JSON object); newest first, at
        most ``limit``. The window prunes the months outside it."""
        chosen = selection(workflow=workflow, status=status, since=since, until=until, where=where)
        return admin.find_runs(self.pool, chosen, limit=limit)[1]

    def cancel_runs(self, *, workflow: str | None = None, status: str | Sequence[str] | None = None,
                    since: datetime | str | None = None, until: datetime | str | None = None,
                    where: str | Mapping[str, Any] | None = None, reason: str = "cancelled by operator",
                    yes: bool = False, chunk: int = admin.CANCEL_CHUNK, actor: Actor | None = None,
                    on_chunk: Callable[[admin.CancelChunk], None] | None = None) -> admin.CancelResult:
        """Cancel every active run the selection (as :meth:`find_runs`) names, through the
        cancel event, ``chunk`` runs per transaction with an audit row each; resumable
        (run it again after an interruption). Without ``yes`` it only lists them."""
        chosen = selection(workflow=workflow, status=status, since=since, until=until, where=where)
        return admin.cancel_runs(self.shell, chosen, reason=reason, yes=yes, actor=actor, chunk=chunk,
                                 on_chunk=on_chunk)

    def retry(self, run_id: str, from_node: str | Sequence[str] | None = None, *, yes: bool = True,
              actor: Actor | None = None) -> admin.RetryResult:
        """Run a FAILED or CANCELLED run again: ``from_node`` (or several; None: the nodes
        that failed) and every node downstream of it run again, tasks cancelled when the
        run ended run again too, and completed upstream outputs are kept. Decided by the
        state machine under the run's lock, recorded with an audit row. ``yes=False``
        decides in a transaction that is rolled back and says what would run again.
        Refused with a clear error for a run that is active or SUCCEEDED, a node that
        does not exist, or a definition version that was deleted."""
        validate_run_id(run_id)
        nodes = () if from_node is None else (from_node,) if isinstance(from_node, str) else tuple(from_node)
        return admin.retry_run(self.shell, run_id, nodes, yes=yes, actor=actor)

    @property
    def queues(self) -> Queues:
        """The queues: ``list()``, ``pause()``, ``resume()``, ``set_limit()`` (engine/queues.py)."""
        return Queues(self.pool)

    def workers(self, *, window_s: float | None = None) -> WorkerReport:
        """The workers seen in the last ``window_s`` seconds (all when None) or still holding a
        lease, live first; the leases the dead and stopped ones hold; lease owners that
        never registered."""
        return admin.workers_report(self.pool, window_s=window_s)


def _check_names(what: str, names: object) -> None:
    """``Invalid`` for one string where a list of names is taken: a string is a sequence
    of strings too, and "default" would be read as the queues d, e, f, a, u, l, t."""
    if isinstance(names, str | bytes):
        raise Invalid(f"{what} must be a list of strings, not one string: got {names!r}")


def _check_workflow_id(workflow_id: object) -> None:
    """Every deployed id matches ID_PATTERN (the validator sees to it), so anything else
    is refused here, before a query, with its text escaped onto one line."""
    if not isinstance(workflow_id, str) or not ID_PATTERN.fullmatch(workflow_id):
        if not isinstance(workflow_id, str):
            raise Invalid(f"a workflow id must be a string (1 to 128 of A-Z a-z 0-9 _ . -), got "
                          f"{type(workflow_id).__name__}")
        shown = json.dumps(workflow_id)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise Invalid(f"workflow id {shown} is not a workflow id (1 to 128 of A-Z a-z 0-9 _ . -)")


def _task_ref(claim: Claim) -> TaskRef:
    return TaskRef(task_id=claim.task_id, run_id=claim.run_id, node_id=claim.node_id, attempt=claim.attempt,
                   lease_owner=claim.lease_owner)
