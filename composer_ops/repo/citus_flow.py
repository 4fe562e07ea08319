"""Flow control for the Citus claim (:func:`composer_ops.repo.citus.claim`): queue limits
and concurrency keys, whose places are ``flow_slots`` rows on the coordinator.

On a single server a trigger frees a task's slot in the transaction that moves the task
out of RUNNING (sql/R__claim.sql). On Citus the tasks live on the worker nodes and the
slots on the coordinator, so nothing frees a slot when its attempt ends: slots are
checked lazily instead. A claim that finds a queue or a key at its limit reads the task
of each of that key's slots on its node (routed by run ID, pipelined) and deletes the
slots whose attempt is over (:func:`composer_ops.core.flow.slot_is_free`), then counts
again. A claim below every limit pays nothing more, and a task leaving RUNNING writes
nothing on the coordinator.

The interleavings (each has a test in tests/citus/test_flow.py):

- a task completing on its node while a claim checks its slot: the check sees it
  RUNNING (the completion has not committed) and keeps the slot; the key stays at its
  limit for this claim, and the next claim frees it. Never over the limit;
- a slot committed on the coordinator before its task's claim commits on the node (the
  two-phase commit commits the coordinator first): the task is still PENDING or QUEUED
  at the slot's attempt, so the slot is held;
- a re-queue after a lost lease: the task is at the next attempt, so the slot of the
  attempt whose lease was lost is free; the next attempt's claim takes a slot anew;
- a run retried: its tasks are made anew, with new IDs, so the slot of the failed
  task finds no task and is free.

Deleting a slot is safe without the key's lock (:func:`free_stale`, the lease sweeper's
pass, takes none): a slot found free stays free, and the delete matches the slot's
``taken_at``, so a slot a claim took again meanwhile (a row taken over by the task's
next attempt) stays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from composer_ops.core.flow import slot_is_free
from composer_ops.repo._base import Conn

#: The queues of a claim with a limit, by name (the order every claim locks them in);
#: none when the claim is fenced off (sql/V007) and is not its retry, so a fenced claim
#: takes no lock.
LIMITED = """
    SELECT queue, max_running FROM queue_settings
     WHERE queue = ANY(%(queues)s) AND NOT paused AND max_running > 0
       AND (%(retry)s OR NOT EXISTS (SELECT 1 FROM claim_fences f WHERE f.claim = %(claim)s))
     ORDER BY queue"""

# The queue's lock, held to the claim's end (as sql/R__claim.sql takes it): a racing claim
# of the queue counts after this one's slots are committed. Then its slots, counted.
_LOCK_QUEUE = "SELECT pg_advisory_xact_lock(hashtext('composer_flow'), hashtext('queue:' || %(queue)s))"
_COUNT = "SELECT count(*) FROM flow_slots WHERE key = %(key)s"

_SLOTS = "SELECT key, run_id, task_id, attempt, taken_at FROM flow_slots WHERE key = ANY(%(keys)s)"
# The keys at their limit, in two reads: the queues and the concurrency keys holding
# places (the coordinator's tables alone), then, only when some key holds places, the
# limits of those keys' ready dispatches (task_outbox: every shard of every node). A key
# without a place is not at its limit (a limit is at least 1), so a cluster using no
# concurrency key reads no shard here.
_HELD = """
    SELECT 'queue:' || s.queue, NULL::bigint FROM queue_settings s
     WHERE s.max_running > 0
       AND (SELECT count(*) FROM flow_slots f WHERE f.key = 'queue:' || s.queue) >= s.max_running
    UNION ALL
    SELECT f.key, count(*) FROM flow_slots f WHERE left(f.key, 2) = 'c:' GROUP BY f.key"""
_KEYS_AT_LIMIT = """
    SELECT 'c:' || w.key FROM (SELECT ckey AS key, max(climit) AS key_limit FROM task_outbox
                                WHERE ckey = ANY(%(keys)s::text[]) AND available_at <= now() GROUP BY ckey) w
      JOIN unnest(%(keys)s::text[], %(held)s::bigint[]) AS h(key, held) ON h.key = w.key
     WHERE h.held >= w.key_limit"""
# Routed to the task's shard (filtered on the run ID).
_TASK = "SELECT attempt, state FROM task_instances WHERE run_id = %(run)s AND id = %(task)s"
_FREE = """
    DELETE FROM flow_slots f
     USING unnest(%(keys)s::text[], %(runs)s::text[], %(tasks)s::text[], %(attempts)s::int[],
                  %(taken)s::timestamptz[]) AS s(key, run_id, task_id, attempt, taken_at)
     WHERE f.key = s.key AND f.run_id = s.run_id AND f.task_id = s.task_id AND f.attempt = s.attempt
       AND f.taken_at = s.taken_at"""

# What composer_flow_admit (sql/R__claim.sql) keeps per key for the rest of the claim: the
# key's running attempts plus what this claim took. Written after a check freed slots.
_RECOUNT = """
    SELECT set_config('composer_flow.c' || md5(k), n::text, true)
      FROM unnest(%(keys)s::text[], %(counts)s::int[]) AS x(k, n)"""

# A slot taken by a claim: the upsert of sql/R__claim.sql (a new attempt of the task
# takes the row over, with a new taken_at).
_TAKE = """
    INSERT INTO flow_slots (key, run_id, task_id, attempt)
    SELECT * FROM unnest(%(keys)s::text[], %(runs)s::text[], %(tasks)s::text[], %(attempts)s::int[])
    ON CONFLICT (key, run_id, task_id) DO UPDATE SET attempt = EXCLUDED.attempt, taken_at = now()"""


def lock_and_count(conn: Conn, queue: str) -> int:
    """Take ``queue``'s limit lock until the transaction ends and count its slots."""
    with conn.cursor() as count:
        with conn.pipeline():
            conn.execute(_LOCK_QUEUE, {"queue": queue})
            count.execute(_COUNT, {"key": "queue:" + queue})
        row = count.fetchone()
    assert row is not None
    return int(row[0])


def held(conn: Conn, keys: Sequence[str]) -> dict[str, int]:
    """Check the slots of ``keys`` (``queue:<name>``, ``c:<key>``) against their tasks,
    delete those that are free, and return how many each key still holds. Three round
    trips: the slots, their tasks (pipelined), the delete."""
    return _check(conn, keys)[0]


def free_stale(conn: Conn) -> int:
    """The lease sweeper's pass on Citus: check the slots of the keys at their limit,
    as a claim would (the queues at their ``max_running``, the concurrency keys with
    ready dispatches whose limit their slots reach: what the reports show as at their
    limit), and delete those whose attempt is over; how many it deleted. Slots of keys
    below their limit are left for the claim that finds them at it."""
    with conn.cursor() as cur:
        held = cur.execute(_HELD).fetchall()
        keys = [str(k) for k, n in held if n is None]
        ckeys = [(str(k)[2:], int(n)) for k, n in held if n is not None]
        if ckeys:
            keys += [str(k) for k, in cur.execute(_KEYS_AT_LIMIT, {"keys": [k for k, _ in ckeys],
                                                                 "held": [n for _, n in ckeys]}).fetchall()]
    return _check(conn, keys)[1] if keys else 0


def _check(conn: Conn, keys: Sequence[str]) -> tuple[dict[str, int], int]:
    """Read the slots of ``keys``, delete the free ones, and count the rest by key
    (every key of ``keys``, 0 when none is left); with how many it deleted."""
    counts = {key: 0 for key in keys}
    with conn.cursor() as cur:
        slots = [tuple(s) for s in cur.execute(_SLOTS, {"keys": list(keys)}).fetchall()]
    if not slots:
        return counts, 0
    seen = [conn.cursor() for _ in slots]
    try:
        with conn.pipeline():
            for cur, (_, run, task, _, _) in zip(seen, slots, strict=True):
                cur.execute(_TASK, {"run": run, "task": task})
        tasks = [cur.fetchone() for cur in seen]
    finally:
        for cur in seen:
            cur.close()
    free: list[tuple[Any, ...]] = []
    for slot, task in zip(slots, tasks, strict=True):
        key, _, _, attempt, _ = slot
        if slot_is_free(attempt, None if task is None else (int(task[0]), str(task[1]))):
            free.append(slot)
        else:
            counts[key] = counts.get(key, 0) + 1
    if not free:
        return counts, 0
    return counts, conn.execute(_FREE, {"keys": [s[0] for s in free], "runs": [s[1] for s in free],
                                        "tasks": [s[2] for s in free], "attempts": [s[3] for s in free],
                                        "taken": [s[4] for s in free]}).rowcount


def recount(conn: Conn, counts: Mapping[str, int]) -> None:
    """Tell composer_flow_admit, for the rest of the transaction, how many places each
    concurrency key (its name, without ``c:``) holds, this claim's included."""
    if counts:
        conn.execute(_RECOUNT, {"keys": list(counts), "counts": list(counts.values())})


def take_statement(slots: Sequence[tuple[str, str, str, int]]) -> tuple[str, dict[str, Any]]:
    """The statement inserting ``slots`` (key, run_id, task_id, attempt), to pipeline."""
    return _TAKE, {"keys": [s[0] for s in slots], "runs": [s[1] for s in slots],
                   "tasks": [s[2] for s in slots], "attempts": [s[3] for s in slots]}


__all__ = ["LIMITED", "free_stale", "held", "lock_and_count", "recount", "take_statement"]
