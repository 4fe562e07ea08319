"""The statements a Citus deployment runs in place of the single-server ones.

On Citus (sql/citus/V002, docs/scaling.md) the run tables are distributed by run ID and
the outbox stays on the coordinator. :func:`claim` is one transaction, not one
statement: the outbox rows are locked on the coordinator, then each task is claimed on
its shard. Because two-phase commit commits the coordinator first, an outbox row whose
task is not visible yet (or still at its earlier attempt) is left for a later claim,
never deleted. :func:`is_citus` says which deployment a connection is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from composer_ops.repo import clock
from composer_ops.repo._base import Conn
from composer_ops.repo.outbox import lock_claim
from composer_ops.repo.rows import Claim


def is_citus(conn: Conn) -> bool:
    """True when the database has the citus extension (a Citus coordinator)."""
    row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')").fetchone()
    return bool(row and row[0])


# On the coordinator, in the clock read's transaction: its now() is that clock.
_PICK = """
    SELECT id, run_id, task_id, attempt, task_name, LEAST(lease_s, max_run_s) AS lease_s, queue, max_run_s
      FROM task_outbox
     WHERE queue = ANY(%(queues)s) AND available_at <= now()
       AND (%(names)s::text[] IS NULL OR task_name = ANY(%(names)s::text[]))
       AND NOT EXISTS (SELECT 1 FROM queue_settings s WHERE s.queue = task_outbox.queue AND s.paused)   -- paused
       AND NOT EXISTS (SELECT 1 FROM claim_fences f WHERE f.claim = %(claim)s)
       -- lease_s: never past start_to_close (max_run_s); queue limits (max_running) are not applied here
     ORDER BY priority DESC, available_at, id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED"""

# The attempt of a task row as this statement sees it (no row: not visible yet), routed
# to its shard; sent before the claim of the same task. In READ COMMITTED each statement
# takes its own snapshot, and a task's attempt only grows, so a row seen here at the
# outbox row's attempt or later is seen by the claim after it at that attempt or later:
# a claim that then matches nothing found that attempt no longer claimable. A row seen at
# an earlier attempt is a re-queue whose worker part has not committed yet (its outbox
# row, on the coordinator, committed first), not a settled task. The other way round is
# not safe: asked after the claim (or in the claim's statement, which Citus may split
# into several queries), the row could move in between, when the transaction creating
# or re-queueing it commits on its node, and a task the claim never saw would be taken
# for a settled one.
_SEEN_ATTEMPT = "SELECT attempt FROM task_instances WHERE run_id = %(run)s AND id = %(task)s"

#: How far a kept outbox row is put back (its ``available_at``, from the claim's clock):
#: the oldest row, it would otherwise be picked first by every claim until its task's
#: transaction commits on its node, which after a worker node's crash is Citus's
#: recovery, up to ``citus.recover_2pc_interval`` (a minute) after the node is back, and
#: a worker claiming one task at a time would get nothing all that while.
KEPT_DELAY = timedelta(seconds=0.25)

_PUT_BACK = "UPDATE task_outbox SET available_at = %(at)s WHERE id = ANY(%(ids)s)"

# One task, routed to its shard (every table named is filtered on the run ID): the
# claim and its history row.
_CLAIM_ONE = """
    WITH claimed AS (
        UPDATE task_instances
           SET state = 'RUNNING', lease_owner = %(owner)s, lease_expires_at = %(expires)s,
               run_deadline_at = %(deadline)s, started_at = %(now)s, updated_at = %(now)s
         WHERE run_id = %(run)s AND id = %(task)s AND attempt = %(attempt)s AND state IN ('PENDING', 'QUEUED')
           AND NOT EXISTS (SELECT 1 FROM workflow_runs r WHERE r.id = %(run)s AND r.deleted_at IS NOT NULL)
        RETURNING node_id, input_json),
         noted AS (
        INSERT INTO run_history (run_id, at, kind, node_id, task_id, attempt, worker, request, detail)
        SELECT %(run)s, %(now)s, 'claimed', node_id, %(task)s, %(attempt)s, %(owner)s, %(claim)s, %(detail)s
          FROM claimed)
    SELECT node_id, input_json AS input FROM claimed"""


def claim(conn: Conn, queues: Sequence[str], owner: str, limit: int,
          task_names: Sequence[str] | None = None, *, claim_id: str) -> list[Claim]:
    """:func:`composer_ops.repo.outbox.claim` on Citus, in the caller's transaction:
    lock up to ``limit`` available outbox rows (FOR UPDATE SKIP LOCKED, on the
    coordinator), claim each task on its shard (fenced on attempt and state, skipping
    soft-deleted runs, with its 'claimed' history row marked ``claim_id``), then delete
    the outbox rows that are settled: claimed, or whose task was seen at the row's
    attempt or later and is not claimable at it. A row whose task is not visible yet,
    or is seen at an earlier attempt, is kept and put back by :data:`KEPT_DELAY`, so
    the rows behind it are picked meanwhile. Its first statement takes the claim's
    advisory lock (:func:`~composer_ops.repo.outbox.lock_claim`, on the coordinator), so
    a retry of the claim waits for it; a claim ID its retry fenced off picks nothing
    (:func:`~composer_ops.repo.outbox.fence_claim`). Three round trips; the clock is
    read once, on the coordinator."""
    with conn.cursor() as clock_cur, conn.cursor(row_factory=dict_row) as pick:
        with conn.pipeline():
            lock_claim(conn, claim_id)          # first, as the single-server claim (sql/R__claim.sql)
            clock_cur.execute(clock.NOW)
            pick.execute(_PICK, {"queues": list(queues), "limit": limit, "claim": claim_id,
                                 "names": list(task_names) if task_names is not None else None})
        now_row = clock_cur.fetchone()
        picked = pick.fetchall()
    assert now_row is not None
    now = now_row[0]
    if not picked:
        return []
    seen = [conn.cursor() for _ in picked]
    cursors = [conn.cursor(row_factory=dict_row) for _ in picked]
    try:
        with conn.pipeline():
            for cur, row in zip(seen, picked, strict=True):
                cur.execute(_SEEN_ATTEMPT, {"run": row["run_id"], "task": row["task_id"]})
            for cur, row in zip(cursors, picked, strict=True):
                cur.execute(_CLAIM_ONE, {
                    "owner": owner, "expires": now + timedelta(seconds=row["lease_s"]), "now": now,
                    "deadline": None if row["max_run_s"] is None else now + timedelta(seconds=row["max_run_s"]),
                    "run": row["run_id"], "task": row["task_id"], "attempt": row["attempt"], "claim": claim_id,
                    "detail": Jsonb({"task": row["task_name"], "lease_s": row["lease_s"]})})
        seen_attempts: list[int | None] = [(cur.fetchone() or (None,))[0] for cur in seen]
        results: list[dict[str, Any]] = [cur.fetchone() or {} for cur in cursors]
    finally:
        for cur in (*seen, *cursors):
            cur.close()
    claims: list[Claim] = []
    settled: list[int] = []
    for row, result, seen_attempt in zip(picked, results, seen_attempts, strict=True):
        if result.get("node_id") is not None:
            settled.append(row["id"])
            claims.append(Claim(run_id=row["run_id"], task_id=row["task_id"], node_id=result["node_id"],
                                attempt=row["attempt"], task_name=row["task_name"], queue=row["queue"],
                                input=result["input"], lease_s=row["lease_s"], lease_owner=owner,
                                lease_expires_at=now + timedelta(seconds=row["lease_s"])))
        elif seen_attempt is not None and seen_attempt >= row["attempt"]:
            settled.append(row["id"])          # cancelled, finished or a stale attempt: nothing to run
    kept = [row["id"] for row in picked if row["id"] not in settled]
    with conn.pipeline():
        if settled:
            conn.execute("DELETE FROM task_outbox WHERE id = ANY(%s)", (settled,))
        if kept:
            conn.execute(_PUT_BACK, {"ids": kept, "at": now + KEPT_DELAY})
    return claims
