"""The statements a Citus deployment runs in place of the single-server ones.

On Citus (sql/citus/V002, docs/scaling.md) the run tables are distributed by run ID and
the outbox stays on the coordinator. :func:`claim` is one transaction, not one
statement: the outbox rows are locked on the coordinator, then each task is claimed on
its shard. Because two-phase commit commits the coordinator first, an outbox row whose
task is not visible yet (or still at its earlier attempt) is left for a later claim,
never deleted. :func:`is_citus` says which deployment a connection is on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from composer_ops.repo import citus_flow, clock
from composer_ops.repo._base import Conn
from composer_ops.repo.outbox import lock_claim
from composer_ops.repo.rows import Claim


def is_citus(conn: Conn) -> bool:
    """True when the database has the citus extension (a Citus coordinator)."""
    row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')").fetchone()
    return bool(row and row[0])


# On the coordinator, in the clock read's transaction: its now() is that clock. The
# queues picked from: those of the claim that are not paused and, with %(limited)s
# false, have no limit (taken together), or, true, have one (each on its own, up to its
# room). The pick is the single server's, composer_pick (sql/R__claim.sql): rows in the
# claim's order, locked, those with a concurrency key or a rate limit taken only when
# composer_flow_admit says so; a key at its limit skips its rows and the walk goes on behind
# them; a paused queue is not in the array it walks. A claim ID fenced by its retry picks
# nothing (a limit of 0), unless this is that retry (%(retry)s). When the pick comes
# short, its second part names the keys the function counted at their limit in this
# transaction, to be checked (citus_flow.held); a full pick does not pay for that scan.
_PICK = """
    WITH open AS (
        SELECT ARRAY(SELECT w.q FROM unnest(%(queues)s::text[]) AS w(q) LEFT JOIN queue_settings s ON s.queue = w.q
                      WHERE NOT COALESCE(s.paused, false)
                        AND (COALESCE(s.max_running, 0) > 0) = %(limited)s) AS queues
    ), chosen AS MATERIALIZED (
        SELECT p.id, p.n
          FROM composer_pick((SELECT queues FROM open)::text[], %(names)s::text[],
                             CASE WHEN NOT %(retry)s AND EXISTS (SELECT 1 FROM claim_fences f WHERE f.claim = %(claim)s)
                                  THEN 0
                                  ELSE %(limit)s END,
                             %(taken)s::bigint[]) WITH ORDINALITY AS p(id, n)
    ), picked AS MATERIALIZED (
        SELECT o.id, o.run_id, o.task_id, o.attempt, o.task_name, LEAST(o.lease_s, o.max_run_s) AS lease_s, o.queue,
               o.max_run_s, o.ckey
          FROM task_outbox o JOIN chosen c ON c.id = o.id
         ORDER BY c.n
    ), keyed AS MATERIALIZED (        -- read on the shards; judged below, on the coordinator
        SELECT DISTINCT ckey, climit
          FROM task_outbox
         WHERE queue = ANY((SELECT queues FROM open)::text[]) AND available_at <= now() AND ckey IS NOT NULL
           AND (%(names)s::text[] IS NULL OR task_name = ANY(%(names)s::text[])))
    SELECT id, run_id, task_id, attempt, task_name, lease_s, queue, max_run_s, ckey FROM picked
    UNION ALL
    SELECT DISTINCT NULL::bigint, NULL, NULL, NULL::int, NULL, NULL::int, NULL, NULL::int, k.ckey
      FROM keyed k
     WHERE (SELECT count(*) FROM picked) < %(limit)s
       AND NULLIF(current_setting('composer_flow.c' || md5(k.ckey), true), '')::int >= k.climit"""

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

# A settled or kept outbox row, named by its key (run_id, id) (sql/citus/V016): the run ID
# routes each statement to the row's shard (by ID alone, one would scan every shard).
_SETTLE = "DELETE FROM task_outbox WHERE run_id = %(run)s AND id = %(id)s"
_PUT_BACK = "UPDATE task_outbox SET available_at = %(at)s WHERE run_id = %(run)s AND id = %(id)s"

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


class _Picks:
    """The outbox rows a claim locked so far, and the keys its picks found at their limit."""

    def __init__(self, conn: Conn, queues: Sequence[str], names: Sequence[str] | None, claim_id: str,
                 retry: bool) -> None:
        self.conn = conn
        self.params: dict[str, Any] = {"queues": list(queues), "claim": claim_id, "retry": retry,
                                       "names": list(names) if names is not None else None}
        self.rows: list[dict[str, Any]] = []
        self.limited: set[int] = set()          # IDs of the rows taken under a queue limit
        self.full: set[str] = set()

    def statement(self, queues: Sequence[str], limit: int, *, limited: bool) -> dict[str, Any]:
        return {**self.params, "queues": list(queues), "limit": limit, "limited": limited,
                "taken": [r["id"] for r in self.rows]}

    def add(self, rows: Sequence[dict[str, Any]], *, limited: bool) -> int:
        taken = [r for r in rows if r["id"] is not None]
        self.rows += taken
        self.full |= {r["ckey"] for r in rows if r["id"] is None}
        if limited:
            self.limited |= {r["id"] for r in taken}
        return len(taken)

    def pick(self, queues: Sequence[str], limit: int, *, limited: bool) -> int:
        with self.conn.cursor(row_factory=dict_row) as cur:
            return self.add(cur.execute(_PICK, self.statement(queues, limit, limited=limited)).fetchall(),
                            limited=limited)


def _pick_limited(picks: _Picks, limited: Sequence[tuple[str, int]], rooms: dict[str, int], limit: int) -> None:
    """Pick from each queue with a limit, up to its room (and the claim's), counting its
    slots under its lock first; a queue at its limit has its slots checked first."""
    for queue, max_running in limited:
        want = limit - len(picks.rows)
        if want <= 0:
            return
        if queue not in rooms:
            held = citus_flow.lock_and_count(picks.conn, queue)
            if held >= max_running:
                held = citus_flow.held(picks.conn, ["queue:" + queue])["queue:" + queue]
            rooms[queue] = max_running - held
        room = min(rooms[queue], want)
        if room > 0:
            rooms[queue] -= picks.pick([queue], room, limited=True)


def claim(conn: Conn, queues: Sequence[str], owner: str, limit: int,
          task_names: Sequence[str] | None = None, *, claim_id: str, retry: bool = False) -> list[Claim]:
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
    (:func:`~composer_ops.repo.outbox.fence_claim`) unless ``retry`` (the retry's own
    claim, after it fenced the ID). Three round trips without limits;
    the clock is read once, on the coordinator.

    Flow control as on a single server (sql/R__claim.sql): a paused queue gives nothing;
    a queue with ``max_running`` gives at most its room, counted under its lock (two
    more round trips per such queue: the count, its pick); concurrency keys and rate limits are
    composer_pick's (sql/R__claim.sql), on the coordinator tables. Each claimed task takes its slots
    (``flow_slots``) in the last round trip. Slots are freed lazily
    (:mod:`composer_ops.repo.citus_flow`): a queue at its limit has its slots checked
    before its pick, and when keys were at their limit and the claim came short, their
    slots are checked and the queues picked once more (a few round trips, only then)."""
    picks = _Picks(conn, queues, task_names, claim_id, retry)
    with conn.cursor() as clock_cur, conn.cursor() as limited_cur, conn.cursor(row_factory=dict_row) as pick:
        with conn.pipeline():
            lock_claim(conn, claim_id)          # first, as the single-server claim (sql/R__claim.sql)
            clock_cur.execute(clock.NOW)
            limited_cur.execute(citus_flow.LIMITED, {"queues": list(queues), "claim": claim_id, "retry": retry})
            pick.execute(_PICK, picks.statement(queues, limit, limited=False))
        now_row = clock_cur.fetchone()
        limited = [(str(q), int(n)) for q, n in limited_cur.fetchall()]
        picks.add(pick.fetchall(), limited=False)
    assert now_row is not None
    now = now_row[0]
    rooms: dict[str, int] = {}
    _pick_limited(picks, limited, rooms, limit)
    if picks.full and len(picks.rows) < limit:
        full = sorted(picks.full)
        held = citus_flow.held(conn, ["c:" + key for key in full])
        ours = Counter(r["ckey"] for r in picks.rows if r["ckey"] is not None)
        citus_flow.recount(conn, {key: held["c:" + key] + ours[key] for key in full})
        picks.pick(queues, limit - len(picks.rows), limited=False)
        _pick_limited(picks, limited, rooms, limit)
    picked = picks.rows
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
    settled: set[int] = set()
    slots: list[tuple[str, str, str, int]] = []
    for row, result, seen_attempt in zip(picked, results, seen_attempts, strict=True):
        if result.get("node_id") is not None:
            settled.add(row["id"])
            claims.append(Claim(run_id=row["run_id"], task_id=row["task_id"], node_id=result["node_id"],
                                attempt=row["attempt"], task_name=row["task_name"], queue=row["queue"],
                                input=result["input"], lease_s=row["lease_s"], lease_owner=owner,
                                lease_expires_at=now + timedelta(seconds=row["lease_s"])))
            if row["id"] in picks.limited:
                slots.append(("queue:" + row["queue"], row["run_id"], row["task_id"], row["attempt"]))
            if row["ckey"] is not None:
                slots.append(("c:" + row["ckey"], row["run_id"], row["task_id"], row["attempt"]))
        elif seen_attempt is not None and seen_attempt >= row["attempt"]:
            settled.add(row["id"])             # cancelled, finished or a stale attempt: nothing to run
    gone = [{"run": row["run_id"], "id": row["id"]} for row in picked if row["id"] in settled]
    kept = [{"run": row["run_id"], "id": row["id"], "at": now + KEPT_DELAY}
            for row in picked if row["id"] not in settled]
    with conn.pipeline(), conn.cursor() as cur:
        if gone:
            cur.executemany(_SETTLE, gone)
        if kept:
            cur.executemany(_PUT_BACK, kept)
        if slots:
            cur.execute(*citus_flow.take_statement(slots))
    return claims


# One distribution value per worker node that holds outbox shards: the key a claim
# passes to composer_claim_node (sql/citus/R__claim_node.sql) so that Citus delegates
# the call to that node. Found by hashing candidate keys until every node has one.
_STREAM_KEYS = """
    SELECT DISTINCT ON (p.groupid) s.k
      FROM generate_series(0, 4095) AS i,
           LATERAL (SELECT 'stream-' || i AS k) AS s,
           LATERAL (SELECT get_shard_id_for_distribution_column('task_outbox', s.k) AS shardid) AS x
      JOIN pg_dist_placement p ON p.shardid = x.shardid
     WHERE p.groupid IN (SELECT DISTINCT pl.groupid FROM pg_dist_shard sh JOIN pg_dist_placement pl USING (shardid)
                          WHERE sh.logicalrelid = 'task_outbox'::regclass)
     ORDER BY p.groupid, i"""


def stream_keys(conn: Conn) -> list[str]:
    """One key per node holding outbox shards (see :data:`_STREAM_KEYS`)."""
    return [str(r[0]) for r in conn.execute(_STREAM_KEYS).fetchall()]


_CLAIM_NODE = "SELECT * FROM composer_claim_node(%s, %s, %s, %s, %s, %s, %s)"


def claim_on_node(conn: Conn, key: str, queues: Sequence[str], owner: str, limit: int,
                  task_names: Sequence[str] | None, *, claim_id: str, retry: bool = False
                  ) -> tuple[list[Claim], bool]:
    """Claim up to ``limit`` tasks from the outbox shards of the node ``key`` hashes to:
    one statement, delegated to that node, in autocommit (a one-node transaction). The
    flag: that node has ready rows only :func:`claim` takes (a limited queue's, or with a
    concurrency key or a rate limit). A claim ID fenced on the node claims nothing there;
    ``retry``: the call of the claim's retry, which fences the ID on the node under the
    claim's lock first, then claims (``limit`` 0: only that)."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(_CLAIM_NODE, (key, list(queues), list(task_names) if task_names is not None else None,
                                         owner, limit, claim_id, retry)).fetchall()
    limited = any(row.pop("limited") for row in rows)
    return [Claim(**row) for row in rows if row["run_id"] is not None], limited
