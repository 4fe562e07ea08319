"""The shell around the pure state machine: one transaction per event.

For each event: lock and load the run (with the database clock), ask the machine, apply
its actions through the repository, commit. A fenced update that matches no row rolls
the event back; transient errors retry it whole. Each event is recorded in the run's
history under its :class:`~composer_ops.engine.requests.Request`; a retry first looks,
under the run lock, for its request's rows and, when the earlier attempt committed,
returns its outcome (``Outcome.duplicate``). Cancelling tasks deletes their outbox rows
before updating the tasks, the claim's lock order.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from composer_ops.core.attempts import HistoryRow
from composer_ops.core.children import child_run_id
from composer_ops.core.expressions import parse_ref, resolve_ref
from composer_ops.core.flow import flow_refs, key_text
from composer_ops.core.machine import decide
from composer_ops.core.model import (
    BufferSignal,
    CancelChild,
    CancelItems,
    CancelRun,
    CancelTasks,
    CompleteTask,
    ConsumeSignal,
    CountItems,
    CreateItems,
    CreateTask,
    Decision,
    DispatchItems,
    Event,
    FailTask,
    FinishChild,
    FinishMap,
    FinishRun,
    NodeState,
    NodeType,
    ReopenRun,
    RequeueTask,
    ResetTasks,
    ResolveWait,
    RunSnapshot,
    RunStatus,
    SignalReceived,
    Stale,
    StartChild,
    StartRun,
    TaskState,
)
from composer_ops.core.spec import NodeSpec, WorkflowSpec, spec_from_json
from composer_ops.db.connect import send_commit, sent_transaction
from composer_ops.db.errors import TranslatingPool
from composer_ops.db.retry import db_retry
from composer_ops.engine import childrows
from composer_ops.engine.ids import uuid7_text
from composer_ops.engine.notes import EventNotes
from composer_ops.engine.reads import NOTHING_YET, LazyContext, RunStore, run_context
from composer_ops.engine.requests import Request
from composer_ops.engine.starts import creates_only
from composer_ops.errors import BrokenRun, ComposerError, Conflict, LockTimeout, NotFound
from composer_ops.repo import (
    citus,
    clock,
    definitions,
    history,
    items,
    locks,
    outbox,
    partitions,
    runs,
    signals,
    tasks,
    writes,
)
from composer_ops.repo._base import Conn
from composer_ops.repo.outbox import ClaimNext
from composer_ops.repo.rows import Claim, Dispatch, NewTask, RunRow

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Definition:
    """A deployed version as the shell needs it; immutable, so cached forever."""

    workflow_id: str
    version: int
    spec: WorkflowSpec
    webhook_url: str | None


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What handling one event did.

    ``refused`` is set when a signal was not delivered although the event changed the
    run (a timeout had finished it first, by the database clock); the caller raises it
    as ``Conflict``. ``duplicate`` when the request had already been applied (an attempt
    whose acknowledgement was lost, or an earlier call with the same signal key): this
    is that first outcome, and nothing was changed now.
    """

    run_id: str
    stale: str | None = None            # the reason, when the event changed nothing
    finished: RunStatus | None = None   # set when this event finished the run
    refused: str | None = None
    duplicate: bool = False
    reset: tuple[str, ...] = ()         # nodes whose tasks a retry removed, to run again
    created: tuple[str, ...] = ()       # nodes whose tasks this event created
    #: tasks claimed in the event's transaction (``claim_next`` of :meth:`Shell.handle`);
    #: None when no claim was made
    claimed: tuple[Claim, ...] | None = None

    @property
    def applied(self) -> bool:
        return self.stale is None


#: Actions that never touch the run's task rows: tasks created before them need not be
#: written first.
_LEAVES_ROWS = (ConsumeSignal, BufferSignal, StartChild, CancelChild)
#: Actions written by the event's one statement (repo/writes.py) rather than on their own.
_IN_ONE_WRITE = (CompleteTask, FailTask, RequeueTask, ResolveWait, FinishChild, FinishMap, FinishRun)


class Shell:
    """Applies events to runs; shared by the Engine, workers and coordinators."""

    def __init__(self, pool: TranslatingPool) -> None:
        self.pool = pool
        self._definitions: dict[tuple[str, int], Definition] = {}
        #: What a start uses (engine/starts.py): the version of (workflow, asked version),
        #: which the server checks is still current, and this host's clock's offset
        #: from the database's, seen in the last answer that carried it.
        self.start_versions: dict[tuple[str, int | None], int] = {}
        self.clock_offset = timedelta(0)
        self._lock = threading.Lock()
        self._citus: bool | None = None
        self._local = threading.local()   # .deliveries: child rows this thread's transactions wrote
        self._odd_runs: set[str] = set()  # runs whose odd data was logged (:meth:`_first_odd`)
        #: How long an operator's call (signal, cancel, retry, bulk cancel) waits for a
        #: run's lock before it gives up (:meth:`run_locked`); None: as long as it takes.
        self.operator_lock_wait_s: float | None = None

    #: At most this many runs are remembered as logged; past it the set starts again.
    MAX_ODD_RUNS = 1000

    def _first_odd(self, run_id: str) -> bool:
        """Whether ``run_id``'s odd data is seen here for the first time (then noted)."""
        with self._lock:
            if run_id in self._odd_runs:
                return False
            if len(self._odd_runs) >= self.MAX_ODD_RUNS:
                self._odd_runs.clear()
            self._odd_runs.add(run_id)
            return True

    # -- definitions -------------------------------------------------------

    def definition(self, conn: Conn, workflow_id: str, version: int) -> Definition:
        key = (workflow_id, version)
        with self._lock:
            cached = self._definitions.get(key)
        if cached is not None:
            return cached
        row = definitions.get_version(conn, workflow_id, version)
        found = Definition(workflow_id=row.id, version=row.version, spec=spec_from_json(row.spec_json),
                           webhook_url=row.webhook_url)
        with self._lock:
            self._definitions[key] = found
        return found

    # -- events ------------------------------------------------------------

    def handle(self, run_id: str, make_event: Callable[[datetime], Event], *,
               request: Request | None = None, lock_wait_s: float | None = None,
               claim_next: ClaimNext | None = None) -> Outcome:
        """Apply one event to one run in one transaction, under the run's row lock;
        ``request`` is the API call it belongs to (a new one when None).
        ``lock_wait_s``: give up when a lock the event needs (its run's first) is not
        granted within that many seconds, raising
        :class:`~composer_ops.errors.LockTimeout` at once, without the retries other
        transient errors get; None waits as long as it takes.

        ``claim_next``: a worker's claim of its next tasks, made in the event's
        transaction when the event is one write (:meth:`apply_sending`) and the
        database a single server: in the write's round trip, before its COMMIT, so a
        completion and the claim that follows it cost one transaction. The tasks are
        ``Outcome.claimed``; none when the event wrote otherwise (the worker claims
        apart then). A retry after a lost acknowledgement that finds the event applied
        returns the tasks that claim took (:func:`outbox.claimed_by`): the claim
        committed with the event or not at all; finding none, it returns None, as the
        attempt that committed may have made no claim."""
        try:
            if lock_wait_s is None:
                outcome = self._handle(run_id, make_event, request or Request(), None, claim_next)
            else:
                outcome = self._handle_or_give_up(run_id, make_event, request or Request(), lock_wait_s)
        except BaseException:
            self.take_deliveries()     # whatever committed of them, the coordinator's loop delivers
            raise
        childrows.drain(self)
        return outcome

    def handle_operator(self, run_id: str, make_event: Callable[[datetime], Event], *,
                        request: Request | None = None) -> Outcome:
        """:meth:`handle` for an operator's call: its locks are waited for at most
        :attr:`operator_lock_wait_s`, then :meth:`run_locked` is raised."""
        wait = self.operator_lock_wait_s
        request = request or Request()
        try:
            return self.handle(run_id, make_event, request=request, lock_wait_s=wait)
        except LockTimeout as exc:
            raise self.run_locked(exc, run_id, retried=request.tries > 1) from exc

    def operator_lock_timeout(self, conn: Conn) -> None:
        """Bound the lock waits of an operator's transaction by :attr:`operator_lock_wait_s`."""
        if self.operator_lock_wait_s is not None:
            partitions.set_lock_timeout(conn, self.operator_lock_wait_s, citus=self.on_citus(conn))

    def run_locked(self, exc: LockTimeout, run_id: str | None = None, *, retried: bool = False,
                   kept: str = "") -> LockTimeout:
        """The error an operator's call gives up with when a run's lock was not granted
        in time (``exc``): one line naming the run and the session holding its row lock
        or, when that cannot be told, the sessions likely holding it (those holding
        locks on its table longest). Looked up on a connection of its own, after the
        call's transaction ended; a lookup that fails leaves the holder unnamed, the
        error the same. ``retried``: the attempt that gave up was a retry after a
        transient error, whose first attempt may have committed (its acknowledgement
        lost), so the line does not say nothing was changed. ``kept``: what earlier
        transactions of the call committed (a bulk action's chunks), said instead."""
        run = exc.run_id or run_id
        waited = f" within {self.operator_lock_wait_s:g}s" if self.operator_lock_wait_s is not None else ""
        try:
            with self.pool.connection() as conn, conn.transaction():
                partitions.set_lock_timeout(conn, locks.LOOKUP_LOCK_WAIT_S)
                rows = []
                if run is not None:
                    try:
                        with conn.transaction():      # a table lock blocks reading the row: ask pg_locks then
                            rows = locks.run_locker(conn, run)
                    except LockTimeout:
                        rows = []
                if rows:
                    holders = "held by " + locks.describe(rows)
                else:
                    rows = locks.lock_holders(conn, ["workflow_runs"], lockers=True)
                    holders = ("likely held by one of: " + locks.describe(rows)) if rows else \
                        "no other session holds a lock on workflow_runs now"
        except ComposerError:
            holders = "its holder could not be looked up"
        what = f"run {run}" if run is not None else "a run"
        if retried:
            changed = ("an earlier attempt of this call may have been applied (its acknowledgement was lost): "
                       f"look at it (composer-ops runs show {run or 'RUN'}) before trying again")
        elif kept:
            changed = f"this step was rolled back, {kept}: run it again once that transaction ends"
        else:
            changed = "nothing was changed: try again once that transaction ends"
        found = LockTimeout(f"{what}: its lock was not granted{waited} ({holders}); {changed}")
        found.run_id = run
        return found

    def _handle_once(self, run_id: str, make_event: Callable[[datetime], Event], request: Request,
                     lock_wait_s: float | None, claim_next: ClaimNext | None = None) -> Outcome:
        look = request.attempt()
        with self.pool.connection() as conn:
            if lock_wait_s is not None:
                with conn.transaction():
                    partitions.set_lock_timeout(conn, lock_wait_s, citus=self.on_citus(conn))
                    return self.handle_in(conn, run_id, make_event, request=request, look=look)
            # Two round trips: BEGIN with the lock and load, the one write with COMMIT.
            with sent_transaction(conn):
                return self.handle_in(conn, run_id, make_event, request=request, look=look, begin=True,
                                      claim_next=claim_next)

    _handle = db_retry()(_handle_once)
    _handle_or_give_up = db_retry(give_up=(LockTimeout,))(_handle_once)

    #: At most this many child rows are kept to deliver after commit, per thread; the
    #: coordinator's loop delivers any others.
    MAX_NOTED_DELIVERIES = 1000

    def note_delivery(self, key: tuple[str, str]) -> None:
        """A child row (run, target) this thread's transaction wrote: :func:`childrows.drain`
        delivers it once the transaction has committed."""
        noted: list[tuple[str, str]] = self._local.__dict__.setdefault("deliveries", [])
        if len(noted) < self.MAX_NOTED_DELIVERIES:
            noted.append(key)

    def take_deliveries(self) -> list[tuple[str, str]]:
        """The rows noted since the last call, forgotten here."""
        noted: list[tuple[str, str]] = self._local.__dict__.get("deliveries", [])
        self._local.deliveries = []
        return noted

    @contextlib.contextmanager
    def rehearsal(self) -> Iterator[None]:
        """This thread's events, in the block, are a dry run's, decided in a transaction the
        caller rolls back: what they would finish is not logged as finished."""
        self._local.rehearsal = True
        try:
            yield
        finally:
            self._local.rehearsal = False

    @property
    def known_single_server(self) -> bool:
        """Whether :meth:`on_citus` has been asked and said no."""
        return self._citus is False

    def on_citus(self, conn: Conn) -> bool:
        """Whether the database is a Citus coordinator, asked once per shell on the
        connection at hand. A single-server database converted to Citus needs its
        engines restarted (docs/scaling.md)."""
        if self._citus is None:
            self._citus = citus.is_citus(conn)
        return self._citus

    def handle_in(self, conn: Conn, run_id: str, make_event: Callable[[datetime], Event], *, request: Request,
                  look: bool = False, begin: bool = False, claim_next: ClaimNext | None = None) -> Outcome:
        """Apply one event to one run in the caller's transaction, under the run's row
        lock, which is held until that transaction ends: what :meth:`handle` does in
        a transaction of its own, and what operator actions that apply one event to
        several runs per transaction call (locking them in run-ID order). ``look``:
        first look for rows ``request`` already wrote (a retry): a duplicate returns their outcome.
        ``begin``: the connection is in autocommit: BEGIN goes with the lock, COMMIT with
        the event's one write when it can (:meth:`apply_sending`); the caller commits
        whatever is left open. ``claim_next``: as :meth:`handle` says."""
        try:
            row, tasks_of_run = runs.lock_and_load(conn, run_id, begin=begin)
        except LockTimeout as exc:
            exc.run_id = exc.run_id or run_id
            raise
        if look:
            earlier = history.of_request(conn, run_id, request.id)
            if earlier:
                replayed = _replayed(run_id, earlier, make_event(row.now))
                asked = None if claim_next is None or self.on_citus(conn) else claim_next.asked()
                # Nothing found: the attempt that committed may have made no claim (an
                # earlier one sent it and rolled back): as if none was made.
                found = [] if asked is None else outbox.claimed_by(conn, asked.owner, asked.claim_id)
                return replace(replayed, claimed=tuple(found)) if found else replayed
        event = make_event(row.now)
        snapshot = self.snapshot(conn, row, tasks_of_run, cancel=isinstance(event, CancelRun))
        decision = decide(snapshot, event, RunStore(conn, run_id), uuid7_text)
        return self.apply_sending(conn, snapshot, decision, event=event, request=request, commit=begin,
                                  claim_next=claim_next)[0]

    def snapshot(self, conn: Conn, row: RunRow, nodes: Mapping[str, NodeState], *,
                 cancel: bool = False) -> RunSnapshot:
        """The machine's view of a locked run and its tasks (:func:`runs.lock_and_load`);
        :class:`BrokenRun` when its definition version does not exist, but for a
        ``cancel``, which needs of the definition only which nodes are MAP and
        SUB_WORKFLOW nodes: it is decided on a stand-in (:func:`_stand_in`)."""
        try:
            spec = self.definition(conn, row.workflow_id, row.workflow_version).spec
        except NotFound:
            if not cancel:
                raise BrokenRun(f"run {row.id}: its definition {row.workflow_id} v{row.workflow_version} does not "
                                "exist, so no event but a cancel can be decided on it; restore that version, or "
                                f"cancel the run (composer-ops cancel {row.id})") from None
            spec = _stand_in(conn, row, nodes)
        return RunSnapshot(
            id=row.id, workflow_id=row.workflow_id, workflow_version=row.workflow_version,
            status=RunStatus(row.status),
            context=run_context(row.context) if row.context is not None
            else LazyContext(lambda: run_context(runs.load_context(conn, row.id))),
            spec=spec, parent_run_id=row.parent_run_id, parent_node_id=row.parent_node_id, nodes=nodes,
        )

    def start_decision(self, conn: Conn, row: RunRow) -> tuple[RunSnapshot, StartRun, Decision]:
        """A run's first decision (the StartRun event at ``row.now``), made before the run
        exists: nothing of it is read. Pure but for the cached definition."""
        snapshot = self.snapshot(conn, row, {})
        event = StartRun(now=row.now)
        return snapshot, event, decide(snapshot, event, NOTHING_YET, uuid7_text)

    def start_sending(self, conn: Conn, request: Request, start: writes.NewRun,
                      decided: tuple[RunSnapshot, StartRun, Decision]) -> writes.Pending | None:
        """Insert a run and apply its first decision (:meth:`start_decision`), returning
        its one write unread (:meth:`apply_sending`). A decision that does more than
        create tasks (:func:`creates_only`: a MAP's items, a child run, which is named
        after its node's creation instant, a run finished at once) is made again with
        the transaction's own clock, read first: those writes are not moved to it
        (sql/R__apply.sql)."""
        snapshot, event, decision = decided
        exact = not creates_only(decision)
        if exact:
            event = StartRun(now=clock.now(conn))
            decision = decide(snapshot, event, NOTHING_YET, uuid7_text)
        return self.apply_sending(conn, snapshot, decision, event=event, request=request, start=start,
                                  exact=exact)[1]

    # -- applying actions --------------------------------------------------

    def apply_sending(self, conn: Conn, run: RunSnapshot, decision: Decision, *, event: Event,
                      request: Request, start: writes.NewRun | None = None, commit: bool = False,
                      exact: bool | None = None,
                      claim_next: ClaimNext | None = None) -> tuple[Outcome, writes.Pending | None]:
        """Write the decision's actions in order, and the event's history; raise (rolling
        back) on a fence miss. ``start``: insert the run first. Returns the outcome and
        the event's one write (:mod:`composer_ops.repo.writes`)
        unread: a start reads it after its COMMIT, pipelined with it. The completions,
        failures and re-queues, the run's finish, the created tasks, the history and the
        dispatches are written by that one statement, after the other actions; what it
        would write so far goes first, by the same function, before an action that may
        touch it (rare: a start whose first decision does more than create tasks, a
        decision that creates, completes or fails tasks before another action).
        ``commit``: the caller's transaction began with an explicit BEGIN (the connection
        in autocommit, :meth:`handle`); when nothing follows the one statement, COMMIT is
        sent with it, in one pipeline (else the caller commits). ``claim_next``: a claim
        sent in that pipeline, between the statement and COMMIT (:meth:`handle`); not
        made otherwise."""
        dispatches: list[Dispatch] = []
        new_rows: list[NewTask] = []
        done: list[writes.Done] = []          # completions, written by the one statement
        failed: list[writes.Fail] = []        # failures and re-queues, likewise
        resolved: list[writes.Resolve] = []   # waiting tasks resolved, likewise
        finish: writes.Finish | None = None
        now = event.now            # the event's one instant (repo.clock), for every write below
        if exact is None:          # decided under the run lock, with this transaction's clock
            exact = start is None
        notes = EventNotes(event, decision, request)
        finished: RunStatus | None = None
        created: str | None = None            # the node of the last CreateTask (a ConsumeSignal follows it)
        creating: list[CreateTask] = []       # consecutive CreateTasks, inserted by one statement
        made: list[str] = []                  # every node created
        later: list[StartChild | CancelChild] = []   # other runs' events: once this run's rows are written
        for action in decision.actions:
            if isinstance(action, Stale):
                # Odd data no later event resolves: said once per run and process, not at
                # every pass of the sweeper that finds its lease expired again.
                if action.odd and self._first_odd(run.id):
                    log.warning("run %s: %s", run.id, action.reason, extra={"action": "odd", "run_id": run.id})
                else:
                    log.info("stale event on run %s: %s", run.id, action.reason,
                             extra={"action": "stale", "run_id": run.id})
                return Outcome(run_id=run.id, stale=action.reason), None
            if isinstance(action, CreateTask):
                creating.append(action)
                created = action.node_id
                made.append(action.node_id)
                continue
            if creating:
                new_rows.extend(self._create(conn, run, creating, dispatches))
                creating = []
            if (new_rows or start is not None or done or failed or resolved or finish is not None) \
                    and not isinstance(action, _LEAVES_ROWS + _IN_ONE_WRITE):
                # what the one statement would write goes first: this action may touch it
                writes.send(conn, writes.document(at=now, run_id=run.id, request=request.id, start=start,
                                                  done=done, failed=failed, resolved=resolved, finish=finish,
                                                  tasks=new_rows, exact=exact)).result()
                start, new_rows, done, failed, resolved, finish = None, [], [], [], [], None
            if isinstance(action, CompleteTask):
                done.append(writes.Done(ref=action.ref, output=action.output,
                                        entry=notes.task_entry("completed", action.ref)))
            elif isinstance(action, FailTask):
                if action.unclaimed and not outbox.take_unstarted(conn, run.id, action.ref.task_id,
                                                                  action.ref.attempt):
                    return Outcome(run_id=run.id, stale=f"task {action.ref.task_id} was claimed in time"), None
                entry = notes.task_entry(notes.failure_kind, action.ref, error=action.reason, requeued=False)
                failed.append(writes.Fail(ref=action.ref, reason=action.reason, entry=entry))
            elif isinstance(action, RequeueTask):
                entry = notes.task_entry(notes.failure_kind, action.ref, error=action.reason, requeued=True,
                                         available_at=action.available_at.isoformat())
                failed.append(writes.Fail(ref=action.ref, reason=action.reason, entry=entry, requeue=True,
                                          lease_expired=action.lease_expired))
                node = run.spec.nodes[action.ref.node_id]
                dispatches.append(Dispatch(run_id=run.id, task_id=action.ref.task_id,
                                           attempt=action.ref.attempt + 1,
                                           queue=node.queue or "default", task_name=node.task or action.ref.node_id,
                                           lease_s=_lease(node.lease_s), available_at=action.available_at,
                                           priority=node.flow.priority, max_run_s=_max_run(node),
                                           start_within_s=node.flow.timeouts.schedule_to_start_s,
                                           **_flow_keys(conn, run, node)))
            elif isinstance(action, ResolveWait):
                resolved.append(writes.Resolve(task_id=action.task_id, state=str(action.state),
                                               output=action.output, reason=action.reason))
                notes.resolved(action)
            elif isinstance(action, BufferSignal):
                signals.buffer_signal(conn, run.id, signal_id=action.signal_id, name=action.name,
                                      payload=action.payload, now=now)
                notes.buffered(action)
            elif isinstance(action, ConsumeSignal):
                _fenced(signals.consume_signal(conn, run.id, action.signal_id, now=now) or None, action)
                notes.consumed(action, created)
            elif isinstance(action, CancelTasks):
                outbox.delete_for_tasks(conn, run.id, action.task_ids)     # outbox rows first: the lock order
                tasks.cancel_tasks(conn, run.id, action.task_ids, action.reason, now=now)
                ids = set(action.task_ids)
                notes.cancel(len(action.task_ids), action.reason,
                             [n for n, slot in run.nodes.items() if slot.task_id in ids])
            elif isinstance(action, FinishRun):
                finish = self._finish(conn, run, action)
                finished = action.status
            elif isinstance(action, ReopenRun):
                _fenced(runs.reopen_run(conn, run.id, str(action.status), now=now) or None, action)
            elif isinstance(action, ResetTasks):
                removed = [*action.task_ids, *items.items_of(conn, run.id, _maps(run, action.node_ids))]
                outbox.delete_for_tasks(conn, run.id, removed)
                _fenced(tasks.reset_tasks(conn, run.id, removed) == len(removed) or None, action)
                notes.reset = action.node_ids
            elif isinstance(action, CreateItems | DispatchItems | CountItems | CancelItems):
                cancelled = self._map_action(conn, run, action, dispatches, now)
                if cancelled and isinstance(action, CancelItems):
                    notes.cancel(cancelled, action.reason, [action.node_id])
            elif isinstance(action, FinishChild | FinishMap):
                resolved.append(writes.Resolve(task_id=action.parent, state=str(action.state), output=action.output,
                                               reason=action.reason, action=type(action).__name__))
            elif isinstance(action, StartChild | CancelChild):
                later.append(action)
                notes.child(action)
        if creating:
            new_rows.extend(self._create(conn, run, creating, dispatches))
        entries = notes.entries()
        sent: writes.Pending | None = None
        claimed: tuple[Claim, ...] | None = None
        tell = decision.finish is not None and run.parent_run_id is not None
        if start is not None or new_rows or entries or dispatches or done or failed or resolved \
                or finish is not None:
            doc = writes.document(at=now, run_id=run.id, request=request.id, start=start, done=done, failed=failed,
                                  resolved=resolved, finish=finish, tasks=new_rows, history=entries,
                                  outbox=dispatches, exact=exact)
            # On Citus no worker registers to be woken (sql/citus/R__dispatch.sql): the
            # shared channel is notified here, in the same transaction (delivered at its
            # commit, not at all if it rolls back).
            woken = sorted({d.queue for d in dispatches}) if dispatches and self.on_citus(conn) else []
            if commit and not later and not tell:
                ask = None if claim_next is None or self.on_citus(conn) else claim_next.ask()
                read_claims: Callable[[], list[Claim]] | None = None
                with conn.pipeline():        # the one statement (and a claim) and COMMIT in one round trip
                    sent = writes.send(conn, doc)
                    if woken:
                        outbox.announce(conn, woken)
                    if ask is not None:
                        read_claims = outbox.claim_sending(conn, ask)
                    send_commit(conn)
                if read_claims is not None:
                    claimed = tuple(read_claims())
            else:
                sent = writes.send(conn, doc)
                if woken:
                    outbox.announce(conn, woken)
                if start is not None and (later or tell):
                    sent.result()         # refused: before the children or the parent hear of this run
        if finished is not None and not self._local.__dict__.get("rehearsal"):
            log.info("run %s %s", run.id, finished, extra={"action": "finish_run", "run_id": run.id})
        for child in later:
            self._child_action(conn, run, child, now)
        ended = decision.finish
        if ended is not None and run.parent_run_id is not None and run.parent_node_id is not None:
            self._tell_parent(conn, run, ended, now)
        return Outcome(run_id=run.id, finished=finished, refused=decision.refused, reset=notes.reset,
                       created=tuple(made), claimed=claimed), sent

    def _create(self, conn: Conn, run: RunSnapshot, creates: Sequence[CreateTask],
                dispatches: list[Dispatch]) -> list[NewTask]:
        """The rows of ``creates``, their dispatches appended to ``dispatches``; written
        by the event's one statement (:mod:`composer_ops.repo.writes`), which rolls the
        event back when a node already has a task."""
        rows = [NewTask(task_id=a.task_id, node_id=a.node_id, node_type=str(a.node_type), queue=_queue(run, a),
                        state=str(a.state), input=a.input, output=a.output, error=a.error, branches=a.branches,
                        wake_at=a.wake_at, signal_name=a.signal_name,
                        items_total=a.items.total if a.items else None,
                        items_started=a.items.started if a.items else None) for a in creates]
        for a in creates:
            if a.node_type is NodeType.TASK and a.state is TaskState.PENDING:
                node = run.spec.nodes[a.node_id]
                dispatches.append(Dispatch(run_id=run.id, task_id=a.task_id, attempt=0,
                                           queue=node.queue or "default", task_name=node.task or a.node_id,
                                           lease_s=_lease(node.lease_s), available_at=a.available_at,
                                           priority=node.flow.priority, max_run_s=_max_run(node),
                                           start_within_s=node.flow.timeouts.schedule_to_start_s,
                                           **_flow_keys(conn, run, node)))
        return rows

    def _child_action(self, conn: Conn, run: RunSnapshot, a: StartChild | CancelChild, now: datetime) -> None:
        """Start or cancel a SUB_WORKFLOW node's child, after this run's own rows are
        written, since the child's first decision may finish it and tell this run at
        once. On a single server in this transaction (under this run's lock, which it
        holds); on Citus through a row on this run's node (engine/childrows.py)."""
        rows = self.on_citus(conn)
        if isinstance(a, StartChild):
            if rows:
                childrows.write_start(conn, self, parent=run.id, node_id=a.node_id, child=a.child_run_id,
                                      workflow=a.workflow, version=a.version, input=a.input, now=now)
                return
            why = childrows.start_child(conn, self, parent=run.id, node_id=a.node_id, child=a.child_run_id,
                                        workflow=a.workflow, version=a.version, input=a.input, request=Request())
            if why is not None:
                childrows.tell_parent(conn, self, child=a.child_run_id, parent=run.id, node_id=a.node_id,
                                      status=RunStatus.FAILED, output=None, error=why, request=Request(),
                                      started=False)
        elif rows:
            childrows.write_cancel(conn, self, parent=run.id, node_id=a.node_id, child=a.child_run_id,
                                   reason=a.reason, now=now)
        else:
            childrows.cancel_child(conn, self, parent=run.id, child=a.child_run_id, reason=a.reason,
                                   request=Request())

    def _tell_parent(self, conn: Conn, run: RunSnapshot, finish: FinishRun, now: datetime) -> None:
        """Deliver this run's finish to its parent: on a single server under the
        parent's lock, in this transaction; on Citus through a row on this run's node."""
        assert run.parent_run_id is not None and run.parent_node_id is not None
        if self.on_citus(conn):
            childrows.write_finish(conn, self, child=run.id, parent=run.parent_run_id, node_id=run.parent_node_id,
                                   status=finish.status, output=finish.output, error=finish.reason, now=now)
            return
        childrows.tell_parent(conn, self, child=run.id, parent=run.parent_run_id, node_id=run.parent_node_id,
                              status=finish.status, output=finish.output, error=finish.reason, request=Request())

    def _map_action(self, conn: Conn, run: RunSnapshot,
                    a: CreateItems | DispatchItems | CountItems | CancelItems,
                    dispatches: list[Dispatch], now: datetime) -> int:
        """Apply one action on a MAP node's items or counters (core/mapnode.py); how many
        active items it cancelled."""
        node = run.spec.nodes[a.node_id]
        queue, name, lease = node.queue or "default", node.task or a.node_id, _lease(node.lease_s)
        if isinstance(a, CreateItems):
            cancelled = a.state is TaskState.CANCELLED
            items.insert_items(conn, run.id, a.node_id, queue=queue, task_ids=a.task_ids, inputs=a.inputs,
                               state=str(a.state), reason="run failed" if cancelled else None, now=now)
            if len(a.task_ids) >= items.ANALYZE_AT and not cancelled:
                items.analyze_new_month(conn, run.id)
            dispatches.extend(Dispatch(run_id=run.id, task_id=task_id, attempt=0, queue=queue, task_name=name,
                                       lease_s=lease, available_at=a.available_at)
                              for task_id in a.task_ids[:a.dispatch])
        elif isinstance(a, DispatchItems):
            found = items.undispatched(conn, run.id, a.node_id, a.indexes)
            _fenced(len(found) == len(a.indexes) or None, a)
            dispatches.extend(Dispatch(run_id=run.id, task_id=task_id, attempt=attempt, queue=queue, task_name=name,
                                       lease_s=lease, available_at=a.available_at) for _, task_id, attempt in found)
        elif isinstance(a, CountItems):
            _fenced(items.count_items(conn, run.id, a.node_id, a.parent, a.items, now=now) or None, a)
        else:
            active = items.active_items(conn, run.id, [a.node_id])
            outbox.delete_for_tasks(conn, run.id, active)     # outbox rows first: the lock order
            tasks.cancel_tasks(conn, run.id, active, a.reason, now=now)
            return len(active)
        return 0

    def _finish(self, conn: Conn, run: RunSnapshot, a: FinishRun) -> writes.Finish:
        """The run's finish as the one statement writes it, with its webhook delivery
        when the definition has one."""
        try:
            defn: Definition | None = self.definition(conn, run.workflow_id, run.workflow_version)
        except NotFound:            # a run cancelled on a stand-in (:meth:`snapshot`): no webhook known
            defn = None
        webhook = None
        if defn is not None and defn.webhook_url:
            webhook = (defn.webhook_url, {
                "run_id": run.id, "workflow_id": run.workflow_id, "workflow_version": run.workflow_version,
                "status": str(a.status), "output": a.output,
                "error": {"error": a.reason} if a.reason else None,
            })
        return writes.Finish(status=str(a.status), reason=a.reason, output=a.output, webhook=webhook)


def _stand_in(conn: Conn, row: RunRow, nodes: Mapping[str, NodeState]) -> WorkflowSpec:
    """For the cancel of a run whose definition version is missing (odd data): a spec of
    its nodes that says what a cancel needs, each node's kind, from its rows: a node
    with item counts is a MAP, one whose derived child run exists a SUB_WORKFLOW (the
    child's ID is the node's and its creation instant's, :func:`child_run_id`), any other
    a TASK, whose task the cancel cancels as it is."""
    stand: dict[str, NodeSpec] = {}
    for node_id, slot in nodes.items():
        kind = NodeType.TASK
        if slot.items is not None:
            kind = NodeType.MAP
        elif slot.state is TaskState.WAITING and slot.created_at is not None \
                and runs.workflow_of(conn, child_run_id(row.id, node_id, slot.created_at)) is not None:
            kind = NodeType.SUB_WORKFLOW
        stand[node_id] = NodeSpec(id=node_id, type=kind)
    return WorkflowSpec(id=row.workflow_id, name=row.workflow_id, nodes=stand)


def _replayed(run_id: str, rows: list[HistoryRow], event: Event) -> Outcome:
    """The outcome of a request that was already applied, from the rows it wrote."""
    details = [r.detail for r in rows if isinstance(r.detail, dict)]
    if isinstance(event, SignalReceived):
        names = [str(d["name"]) for d in details if "name" in d]
        if names and event.name not in names:
            raise Conflict(f"run {run_id}: this signal key was used for signal {names[0]!r}, "
                           f"not {event.name!r}")
    finished = next((d["finished"] for d in details if "finished" in d), None)
    refused = next((d["refused"] for d in details if "refused" in d), None)
    log.info("run %s: request already applied (%s); returning its outcome", run_id, rows[0].request,
             extra={"action": "duplicate", "run_id": run_id})
    return Outcome(run_id=run_id, finished=RunStatus(finished) if finished else None, refused=refused,
                   duplicate=True)


def _queue(run: RunSnapshot, a: CreateTask) -> str | None:
    """The queue a created task is dispatched on (TASK nodes only)."""
    if a.node_type is NodeType.TASK or a.node_type is NodeType.MAP:
        return run.spec.nodes[a.node_id].queue or "default"
    return None


def _maps(run: RunSnapshot, node_ids: Sequence[str]) -> list[str]:
    """The MAP nodes among ``node_ids``."""
    return [n for n in node_ids if n in run.spec.nodes and run.spec.nodes[n].type is NodeType.MAP]


def _lease(lease_s: float) -> int:
    return max(1, int(round(lease_s)))


def _flow_keys(conn: Conn, run: RunSnapshot, node: NodeSpec) -> dict[str, Any]:
    """The dispatch's concurrency key and rate limit, their $. references resolved against
    the run's input, config and the referenced upstream outputs (loaded only then); empty
    for a node without them."""
    flow = node.flow
    if flow.concurrency is None and flow.rate_limit is None:
        return {}
    refs = [text for _, text in flow_refs(flow)]
    upstream = {r.node for r in map(parse_ref, refs) if r.node is not None}
    outputs = runs.load_outputs(conn, run.id, sorted(upstream)) if upstream else {}

    def value(text: str) -> str:
        return key_text(resolve_ref(parse_ref(text), run.context, outputs))

    keys: dict[str, Any] = {}
    if flow.concurrency is not None:
        keys.update(ckey=value(flow.concurrency.key), climit=flow.concurrency.limit)
    if flow.rate_limit is not None:
        rate = flow.rate_limit
        keys.update(rkey=value(rate.key) if rate.key_is_ref else rate.key, rate_per_s=rate.per_s,
                    rate_burst=rate.burst)
    return keys


def _max_run(node: NodeSpec) -> int | None:
    """The node's start_to_close_s in whole seconds (at least 1), None without one."""
    limit = node.flow.timeouts.start_to_close_s
    return None if limit is None else max(1, int(round(limit)))


def _fenced(result: Any, action: object) -> Any:
    """A fenced write that matched nothing: roll the whole event back."""
    if result is None:
        raise Conflict(f"fenced write matched no row ({type(action).__name__}); "
                       "the task changed outside the engine, the event was rolled back")
    return result
