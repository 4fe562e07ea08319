"""The dispatch outbox: written with the task in one transaction, claimed by workers.

The claim is one call of ``composer_claim`` (sql/R__claim.sql): an advisory lock on its
claim ID (which a retry waits for, :func:`lock_claim`), then the oldest available rows of
its queues deleted FOR UPDATE SKIP LOCKED, their tasks moved to RUNNING with a lease,
fenced on attempt, and a 'claimed' history row each. Lock order: a transaction touching
a task and its outbox row locks the outbox row first (the claim, and the shell when it
cancels tasks), so the two never deadlock. Idle workers' registrations are taken by a
dispatch with SKIP LOCKED, inserted by a claim before it locks anything else, and
written at its end with SKIP LOCKED.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from psycopg import sql
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from composer_ops.repo._base import Conn, fetch_all, iso
from composer_ops.repo.rows import Claim, Dispatch, Unstarted
from composer_ops.repo.workers import DEAD_AFTER

#: LISTEN/NOTIFY channel every worker listens on; the payload is the queue name. A
#: dispatch notifies it only for rows no registered worker is handed (see :func:`enqueue`).
CHANNEL = "composer_tasks"


def wake_channel(worker: str) -> str:
    """The channel only ``worker`` listens on, named after it (an identifier of at most
    63 bytes, whatever the worker's ID). A notification there carries the total of
    wake-ups handed to the worker so far (``task_waiters.promised``), or nothing: told
    with no wake-up handed (sql/R__dispatch.sql)."""
    return "composer_wake_" + hashlib.sha1(worker.encode()).hexdigest()[:32]


def dispatch_rows(dispatches: Sequence[Dispatch]) -> list[dict[str, Any]]:
    """The outbox rows of ``dispatches`` as ``composer_enqueue`` (sql/R__dispatch.sql)
    reads them: one JSON object each, a key left out where its value is None."""
    return [{k: v for k, v in {
        "q": d.queue, "r": d.run_id, "t": d.task_id, "a": d.attempt, "n": d.task_name, "l": d.lease_s,
        "av": iso(d.available_at), "p": d.priority or None, "m": d.max_run_s, "w": d.start_within_s,
        "ck": d.ckey, "cl": d.climit, "rk": d.rkey, "rp": d.rate_per_s, "rb": d.rate_burst}.items()
        if v is not None} for d in dispatches]


def dispatch_groups(rows: Sequence[dict[str, Any]]) -> tuple[str, str, str, str]:
    """The groups of outbox rows (:func:`dispatch_rows`) as ``composer_enqueue`` takes
    them, beside the rows (:func:`groups`), as four PostgreSQL array literals (text[],
    text[], int[], int[]), which a string parameter passes more cheaply than a list."""
    queues, names, counts, places = groups(rows)
    return _texts(queues), _texts(names), _ints(counts), _ints(places)


def groups(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[str], list[int], list[int]]:
    """Each (queue, task name) of ``rows`` once, in that order, with its count of rows;
    and the rows' places (from 1) by group, then by place. Computed here, where it costs
    a sort of the rows, rather than by a query in the dispatch (docs/performance-log.md,
    "The dispatch's groups")."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["q"], rows[i]["n"]))
    queues: list[str] = []
    names: list[str] = []
    counts: list[int] = []
    for i in order:
        queue, name = rows[i]["q"], rows[i]["n"]
        if counts and queues[-1] == queue and names[-1] == name:
            counts[-1] += 1
        else:
            queues.append(queue)
            names.append(name)
            counts.append(1)
    return queues, names, counts, [i + 1 for i in order]


def _texts(values: Iterable[str]) -> str:
    """A text[] literal of ``values``, each quoted."""
    return "{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"


def _ints(values: Iterable[int]) -> str:
    """An int[] literal of ``values``."""
    return "{" + ",".join(map(str, values)) + "}"


def enqueue(conn: Conn, dispatches: Sequence[Dispatch], *, now: datetime) -> None:
    """Write outbox rows, available from ``now`` unless a retry's backoff says later,
    and wake idle workers for them (NOTIFY is delivered at commit, and only if the
    transaction commits): one call of ``composer_enqueue`` (sql/R__dispatch.sql), one
    round trip, however many rows and queues; the rows go in as one JSON document
    (:func:`dispatch_rows`), as an event's one write (:mod:`composer_ops.repo.writes`)
    passes them for its dispatches.

    Workers are registered in ``task_waiters`` by their own claims with their free
    slots (sql/R__claim.sql). The dispatch hands each waiter, the most recently
    registered first, up to as many of the rows it serves as it has room for, with one
    notification on its own channel; rows left go to busy waiters, one each (two beyond
    a waiter's room at most), and one row still left is told to the least over-promised
    waiter with an empty payload. Each row handed out and ready now is written with
    its waiter (``handed_to``), to which other workers' woken claims leave it for a
    second while that waiter has wake-ups still to take up.
    Only rows beyond that (or every row, when a
    waiter handed some does not serve them all) are announced on :data:`CHANNEL`, once
    per queue. The poll is the safety net: a wake-up lost (a killed waiter's row
    outlives it) costs its row at most a poll interval of an idle worker
    (sql/R__dispatch.sql)."""
    if not dispatches:
        return
    rows = dispatch_rows(dispatches)
    conn.execute("SELECT composer_enqueue(%s, %s, interval '0', %s::text[], %s::text[], %s::int[], %s::int[])",
                 (Jsonb(rows), now, *dispatch_groups(rows)))


def listen(conn: Conn, channel: str = CHANNEL) -> None:
    """Subscribe ``conn`` (an autocommit connection of its own) to ``channel``."""
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


_CLAIM = """
        SELECT run_id, task_id, node_id, attempt, task_name, queue, input, lease_s, lease_owner, lease_expires_at
          FROM composer_claim(%(queues)s, %(names)s::text[], %(owner)s, %(limit)s, %(claim)s, %(channel)s,
                              %(room)s, %(seen)s::bigint, %(busy)s::text[], %(woken)s)"""


@dataclass(frozen=True, kw_only=True)
class ClaimAsk:
    """What a claim asks for: up to ``limit`` available tasks of ``queues`` for
    ``owner`` (only tasks named in ``task_names`` when given: a worker never takes work
    it has no handler for), each recorded in its run's history as claimed by
    ``claim_id``. With ``wake`` (the channel ``owner`` listens on), the claim registers
    ``owner`` to be woken there by dispatches (:func:`enqueue`) for as many tasks as it
    has room for afterwards (``room``: the tasks ``owner`` had room for, default
    ``limit``; a worker claiming ahead asks for more and may leave a room below zero,
    which a dispatch's first pass skips and its second hands one wake-up at most), less
    the wake-ups on their way to it (``seen``: the total of wake-ups handed to ``owner``
    it has taken up, the payloads of its channel; None: all).
    ``busy``: the runs ``owner`` has tasks of in flight, whose ready tasks the claim
    takes after others of the same priority (sql/R__claim.sql composer_pick, "spread
    over runs"; not named on Citus, whose pick spreads only its own rows). ``woken``:
    ``owner`` claims because it was woken; with ``wake`` it leaves tasks handed to
    another registered worker with wake-ups still to take up to that worker, for their
    first second ready (sql/R__claim.sql, composer_pick's p_me; not on Citus, where none
    is handed)."""

    queues: tuple[str, ...]
    owner: str
    limit: int
    claim_id: str
    task_names: tuple[str, ...] | None = None
    wake: str | None = None
    room: int | None = None
    seen: int | None = None
    busy: tuple[str, ...] = ()
    woken: bool = False

    def ask(self) -> ClaimAsk:
        """This claim, as a :class:`ClaimNext` asks for it."""
        return self

    def asked(self) -> ClaimAsk:
        """This claim, as a :class:`ClaimNext` says it was asked for."""
        return self

    def params(self) -> dict[str, Any]:
        return {"queues": list(self.queues), "owner": self.owner, "limit": self.limit, "claim": self.claim_id,
                "channel": self.wake, "seen": self.seen,
                "room": self.limit if self.room is None else self.room,
                "names": list(self.task_names) if self.task_names is not None else None,
                "busy": list(self.busy) if self.busy else None, "woken": self.woken}


class ClaimNext(Protocol):
    """A claim made with an event, in its transaction (``claim_next`` of
    :meth:`composer_ops.engine.shell.Shell.handle`); a :class:`ClaimAsk` is one, and a
    worker's report makes one that decides at the last moment."""

    def ask(self) -> ClaimAsk | None:
        """The claim to send with the event's one write, asked just before it is sent
        (again by a retry of the event), or None: no claim."""
        ...

    def asked(self) -> ClaimAsk | None:
        """The claim an earlier attempt sent, if any: a retry that finds the event
        applied returns its tasks."""
        ...


def claim(conn: Conn, queues: Sequence[str], owner: str, limit: int,
          task_names: Sequence[str] | None = None, *, claim_id: str, wake: str | None = None,
          room: int | None = None, seen: int | None = None, woken: bool = False) -> list[Claim]:
    """Claim what :class:`ClaimAsk` of these says, in one statement (``composer_claim``)."""
    ask = ClaimAsk(queues=tuple(queues), owner=owner, limit=limit, claim_id=claim_id,
                   task_names=None if task_names is None else tuple(task_names), wake=wake, room=room, seen=seen,
                   woken=woken)
    return fetch_all(conn, Claim, _CLAIM, ask.params())


def claim_sending(conn: Conn, ask: ClaimAsk) -> Callable[[], list[Claim]]:
    """:func:`claim`, sent and not read: the returned function reads the tasks claimed.
    In a pipeline the statement goes in the pipeline's round trip (a completion's claim
    of the next tasks, :meth:`composer_ops.engine.shell.Shell.handle`), and its rows are
    read after the pipeline's sync."""
    cur = conn.cursor(row_factory=class_row(Claim))
    cur.execute(_CLAIM, ask.params())
    return cur.fetchall


def register(conn: Conn, queues: Sequence[str], owner: str, task_names: Sequence[str] | None, *, wake: str,
             room: int, seen: int) -> None:
    """Register ``owner`` as idle with ``room`` free slots, woken on channel ``wake``,
    having taken up ``seen`` wake-ups: what a claim writes (sql/R__claim.sql), for a
    worker whose last claim filled its slots and left nothing ready, once a slot frees
    (a claim then would come back empty). Waits for a dispatch holding the row."""
    conn.execute("""
        INSERT INTO task_waiters AS w (worker, channel, queues, task_names, slots, promised, seen)
        VALUES (%(owner)s, %(wake)s, %(queues)s, %(names)s::text[], %(room)s, %(seen)s, %(seen)s)
        ON CONFLICT (worker) DO UPDATE
           SET channel = EXCLUDED.channel, queues = EXCLUDED.queues, task_names = EXCLUDED.task_names,
               slots = EXCLUDED.slots, promised = GREATEST(w.promised, EXCLUDED.seen),
               seen = GREATEST(w.seen, EXCLUDED.seen), since = now()""",
                 {"owner": owner, "wake": wake, "queues": list(queues), "room": room, "seen": seen,
                  "names": list(task_names) if task_names is not None else None})


def unregister(conn: Conn, owner: str, *, seen: int | None, told: bool) -> bool:
    """``owner`` waits for tasks no more (a worker stopping: it claims nothing from now
    on): its registration is deleted, so no dispatch hands it a wake-up it would not act
    on. Wake-ups handed to it that it had not taken up (``promised`` beyond ``seen``, or
    beyond what its last claim wrote when None), or the word it was told (``told``: on
    the shared channel, or on its own with an empty payload) and had not claimed for,
    are passed on: every worker serving its queues is told on the shared channel, as
    their rows wait in the outbox. Waits for a dispatch holding the row, and reads what
    it handed out. True when it was told on."""
    _, told_on = _forget(conn, "w.worker = %(owner)s", "w.promised > COALESCE(%(seen)s, w.seen) OR %(told)s",
                               {"owner": owner, "seen": seen, "told": told})
    return told_on > 0


#: How long a registration stays unrefreshed (``since``, which each claim of its worker
#: writes) before :func:`forget_dead` may take its worker for gone when the workers
#: registry does not show it live: a worker's first claims may come before its
#: registry row.
DEAD_WAITER_GRACE_S = 60.0


def forget_dead(conn: Conn, grace_s: float = DEAD_WAITER_GRACE_S) -> int:
    """Delete the registrations of workers that are gone: not refreshed for ``grace_s``
    seconds, and whose worker the registry (``workers``) shows stopped, dead
    (:data:`~composer_ops.repo.workers.DEAD_AFTER` heartbeat intervals silent) or not at
    all. A killed worker's row outlives it: dispatches would hand it wake-ups up to its
    room and two beyond, and the wake-ups it was handed and never took up would count,
    in every claim's ``composer_uncovered`` (sql/R__claim.sql), as covering ready rows,
    so claims that fill their slots would leave those rows to the polls. Wake-ups not
    taken up are told on the shared channel, as :func:`unregister` does. Rows a
    dispatch or a claim holds are skipped, never waited for. Returns the rows deleted.

    A live worker whose registry heartbeats failed for a while (the database out for
    more than a minute) can lose its row this way: its next claim writes it again, and
    until then no dispatch wakes it (its poll still claims)."""
    deleted, _ = _forget(conn, f"""
        w.worker IN (SELECT x.worker FROM task_waiters x
                      WHERE x.since < now() - make_interval(secs => %(grace)s)
                        AND NOT EXISTS (
                            SELECT 1 FROM workers k
                             WHERE k.id = x.worker AND k.stopped_at IS NULL
                               AND k.last_seen_at >= now() - make_interval(secs => {DEAD_AFTER} * k.heartbeat_s))
                        FOR UPDATE SKIP LOCKED)""", "w.promised > w.seen", {"grace": grace_s})
    return deleted


def _forget(conn: Conn, which: str, owed: str, params: dict[str, Any]) -> tuple[int, int]:
    """Delete the registrations ``which`` selects (SQL over ``task_waiters w``) and tell
    the shared channel, once per queue, of those where ``owed`` (SQL over the row) holds:
    (rows deleted, notifications sent). The one statement of :func:`unregister` and
    :func:`forget_dead`."""
    row = conn.execute(f"""
        WITH gone AS (DELETE FROM task_waiters w WHERE {which} RETURNING w.queues, {owed} AS owed)
        SELECT (SELECT count(*) FROM gone),
               (SELECT count(pg_notify(%(channel)s, q.q))
                  FROM (SELECT DISTINCT u.q FROM gone, unnest(gone.queues) AS u(q) WHERE gone.owed) AS q)""",
                       {**params, "channel": CHANNEL}).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def promised(conn: Conn, owner: str) -> int:
    """The total of wake-ups handed to ``owner`` so far (``task_waiters.promised``; 0 when
    it is not registered): what the notifications on its channel carry, read by a worker
    once it listens, as those sent before reached no one."""
    row = conn.execute("SELECT promised FROM task_waiters WHERE worker = %s", (owner,)).fetchone()
    return 0 if row is None else int(row[0])


#: The lock a claim takes as its first step (sql/R__claim.sql, and :func:`composer_ops.repo.citus.claim`),
#: until it commits or rolls back: two int4 keys, a space apart from the one-bigint keys.
_LOCK_CLAIM = "SELECT pg_advisory_xact_lock(hashtext('composer_claim'), hashtext(%(claim)s))"


def lock_claim(conn: Conn, claim_id: str) -> None:
    """Wait for any other transaction of claim ``claim_id`` to commit or roll back, and
    hold its lock for the rest of the caller's transaction. What a retried claim does
    before :func:`claimed_by`: an attempt still executing or committing on the server
    when its client gave up holds the lock, so the retry's look sees what it committed."""
    conn.execute(_LOCK_CLAIM, {"claim": claim_id})


def fence_claim(conn: Conn, claim_id: str) -> None:
    """Fence claim ``claim_id`` off, in the caller's transaction: an attempt of it that
    reaches the server once this commits claims nothing (``claim_fences``, checked by
    the claim after its advisory lock). What a retried claim writes after it looked and
    claimed, under :func:`lock_claim`. Fences older than a day go in the same statement."""
    conn.execute("""
        WITH old AS (DELETE FROM claim_fences WHERE at < now() - interval '1 day')
        INSERT INTO claim_fences (claim) VALUES (%(claim)s) ON CONFLICT (claim) DO NOTHING""",
                 {"claim": claim_id})


def claimed_by(conn: Conn, owner: str, claim_id: str) -> list[Claim]:
    """The tasks claim ``claim_id`` took for ``owner`` that ``owner`` still holds: what a
    claim retried after a lost acknowledgement returns instead of claiming again. Reads
    the RUNNING tasks (few, through their partial index) and each one's history."""
    return fetch_all(conn, Claim, """
        SELECT t.run_id, t.id AS task_id, t.node_id, t.attempt, h.detail->>'task' AS task_name,
               COALESCE(t.queue, 'default') AS queue, t.input_json AS input, (h.detail->>'lease_s')::int AS lease_s,
               t.lease_owner, t.lease_expires_at
          FROM task_instances t
          JOIN run_history h ON h.run_id = t.run_id AND h.task_id = t.id AND h.attempt = t.attempt
         WHERE t.state = 'RUNNING' AND t.lease_owner = %(owner)s
           AND h.kind = 'claimed' AND h.request = %(claim)s
         ORDER BY t.run_id, t.id""", {"owner": owner, "claim": claim_id})


def unstarted(conn: Conn, limit: int, *, now: datetime, skip: Sequence[str] = ()) -> list[Unstarted]:
    """Dispatches whose schedule_to_start deadline (``start_by``) had passed at ``now``
    (the database clock), the most overdue first, through their partial index; ``skip``:
    ``task_id:attempt`` keys the caller is backing off."""
    return fetch_all(conn, Unstarted, """
        SELECT run_id, task_id, attempt FROM task_outbox
         WHERE start_by <= %(now)s AND task_id || ':' || attempt <> ALL(%(skip)s::text[])
         ORDER BY start_by LIMIT %(limit)s""", {"now": now, "skip": list(skip), "limit": limit})


def take_unstarted(conn: Conn, run_id: str, task_id: str, attempt: int) -> int:
    """Delete the dispatch of a task's attempt if its schedule_to_start deadline has passed
    by the database clock; 0 when a claim took it first (the task is RUNNING then). Runs
    under the run's lock, before the task is failed (the lock order: outbox row first)."""
    return conn.execute("DELETE FROM task_outbox WHERE run_id = %s AND task_id = %s AND attempt = %s "
                        "AND start_by <= now()", (run_id, task_id, attempt)).rowcount


def raise_waiting(conn: Conn, older_than_s: float) -> int:
    """Raise every dispatch ready for more than ``older_than_s`` (the database clock) and
    below its queue's highest priority to that priority. The priority aging of the
    coordinator's timer loop, called in autocommit: one read, then one single-row update
    per aged dispatch, each its own transaction. So the pass never holds one row's lock
    while it waits for another's (a claim or a cancel holding several rows cannot
    deadlock with it), a row a claim holds is waited for briefly (the claim deletes it,
    and then it is not raised), and on Citus each update names its run and commits on
    that run's node in one phase."""
    aged = conn.execute("""
        SELECT o.run_id, o.id, top.priority
          FROM task_outbox o
          JOIN (SELECT queue, max(priority) AS priority FROM task_outbox GROUP BY queue) top ON top.queue = o.queue
         WHERE o.priority < top.priority AND o.available_at <= now() - make_interval(secs => %s)""",
        (older_than_s,)).fetchall()
    raised = 0
    for run_id, outbox_id, priority in aged:
        raised += conn.execute("UPDATE task_outbox SET priority = %s WHERE run_id = %s AND id = %s AND priority < %s",
                               (priority, run_id, outbox_id, priority)).rowcount
    return raised


def announce(conn: Conn, queues: Sequence[str]) -> None:
    """Notify the shared channel of ``queues``, in the caller's transaction (delivered at
    its commit). On Citus, where a dispatch is written on its run's worker node (the
    event's one statement, :mod:`composer_ops.repo.writes`, routed there) and a NOTIFY
    there reaches no worker."""
    conn.execute("SELECT pg_notify(%s, q) FROM unnest(%s::text[]) AS u(q)", (CHANNEL, list(queues)))


def delete_for_tasks(conn: Conn, run_id: str, task_ids: Sequence[str]) -> int:
    """Drop pending dispatches of the given tasks (cancelled tasks); runs before their
    tasks are updated (the lock order above)."""
    if not task_ids:
        return 0
    cur = conn.execute("DELETE FROM task_outbox WHERE run_id = %s AND task_id = ANY(%s)",
                       (run_id, list(task_ids)))
    return cur.rowcount


def delete_for_run(conn: Conn, run_id: str) -> int:
    """Drop every pending dispatch of a run (a deleted run has none left to run)."""
    return conn.execute("DELETE FROM task_outbox WHERE run_id = %s", (run_id,)).rowcount
