"""The coordinator's scans on Citus, one call per worker node.

On a single server, and on Citus when the nodes do not cover every shard, the timers,
the lease sweeper, the start timeouts, the children loop and the webhook relay read
their candidates with the statements of :func:`composer_ops.repo.signals.due_waits`,
:func:`composer_ops.repo.tasks.expired_leases`, :func:`composer_ops.repo.outbox.unstarted`,
:func:`composer_ops.repo.deliveries.pending` and :func:`composer_ops.repo.webhooks.due`;
on Citus each of those runs over every shard through the coordinator. :func:`scan_node`
asks one node instead: ``composer_scan_node`` (sql/citus/R__scan_node.sql), delegated to
the node a stream key hashes to (:func:`composer_ops.repo.citus.stream_keys`), reads
that node's shards with the same predicates and returns the five kinds of candidates.
:func:`covered` keeps one key per node and says whether those nodes hold every shard,
the condition for the node scans to see what the statements would, each once.
:func:`prune_webhooks_on_node` is the webhook prune of one node, a local one-phase
transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from psycopg.rows import dict_row

from composer_ops.repo._base import Conn
from composer_ops.repo.rows import DueWait, DueWebhook, ExpiredLease, PendingChild, Unstarted

#: The kinds of the timers, the lease sweeper and the start timeouts: due timers,
#: expired leases, unstarted dispatches.
KINDS = ("timer", "lease", "start")

#: Every kind a node scan reads: :data:`KINDS`, the children loop's pending child rows
#: and the webhook relay's due deliveries.
ALL_KINDS = (*KINDS, "child", "webhook")

#: The distributed tables whose shards the node scans and the node prune read.
SCANNED_TABLES = ("workflow_runs", "task_instances", "task_outbox", "child_deliveries", "webhook_deliveries")

#: A candidate of a node scan, of any kind.
Candidate = DueWait | ExpiredLease | Unstarted | PendingChild | DueWebhook


@dataclass
class NodeScan:
    """Candidates found by node scans: each list in the single server's order."""

    timers: list[DueWait] = field(default_factory=list)
    leases: list[ExpiredLease] = field(default_factory=list)
    starts: list[Unstarted] = field(default_factory=list)
    children: list[PendingChild] = field(default_factory=list)
    webhooks: list[DueWebhook] = field(default_factory=list)


_SCAN = "SELECT * FROM composer_scan_node(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"


def scan_node(conn: Conn, key: str, *, now: datetime, floor: str, limit: int, kinds: Sequence[str],
              ceiling: str | None = None, skip_timers: Sequence[str] = (), skip_leases: Sequence[str] = (),
              skip_starts: Sequence[str] = (), skip_children: Sequence[str] = ()
              ) -> list[tuple[datetime, Candidate]]:
    """Up to ``limit`` candidates of each of ``kinds`` on the node ``key`` hashes to, each
    with its sort time (wake-up, lease expiry, start deadline, a child row's writing, a
    delivery's next attempt): one statement, delegated to that node, in autocommit.
    ``now`` is the coordinator's clock, ``floor`` the active floor, ``ceiling`` the
    active ceiling (:func:`composer_ops.core.runids.active_ceiling`; None: none), the
    ``skip_*`` keys those of the statements they replace."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(_SCAN, (key, now, floor, ceiling, limit, list(kinds), list(skip_timers), list(skip_leases),
                                   list(skip_starts), list(skip_children)), prepare=False).fetchall()
    found: list[tuple[datetime, Candidate]] = []
    for r in rows:
        kind, run_id = r["kind"], r["run_id"]
        candidate: Candidate
        if kind == "timer":
            candidate = DueWait(run_id=run_id, task_id=r["task_id"], node_id=r["node_id"])
        elif kind == "lease":
            candidate = ExpiredLease(run_id=run_id, task_id=r["task_id"], node_id=r["node_id"], attempt=r["attempt"],
                                     lease_owner=r["lease_owner"], timed_out=bool(r["timed_out"]))
        elif kind == "start":
            candidate = Unstarted(run_id=run_id, task_id=r["task_id"], attempt=r["attempt"])
        elif kind == "child":
            candidate = PendingChild(run_id=run_id, target_run_id=r["target_run_id"])
        else:
            candidate = DueWebhook(run_id=run_id, id=int(r["delivery_id"]))
        found.append((r["at"], candidate))
    return found


def merge(found: Sequence[tuple[datetime, Candidate]], limit: int, *, webhook_limit: int | None = None) -> NodeScan:
    """The candidates of several nodes as one :class:`NodeScan`: per kind, the ``limit``
    first by sort time (each node returned its own first ``limit``); of the webhook
    deliveries, the ``webhook_limit`` first (None: ``limit``)."""
    ordered = sorted(found, key=lambda pair: pair[0])
    scan = NodeScan()
    scan.timers = [c for _, c in ordered if isinstance(c, DueWait)][:limit]
    scan.leases = [c for _, c in ordered if isinstance(c, ExpiredLease)][:limit]
    scan.starts = [c for _, c in ordered if isinstance(c, Unstarted)][:limit]
    scan.children = [c for _, c in ordered if isinstance(c, PendingChild)][:limit]
    webhooks = [c for _, c in ordered if isinstance(c, DueWebhook)]
    scan.webhooks = webhooks[:limit if webhook_limit is None else webhook_limit]
    return scan


# The keys' nodes: each group reached by a key, with the first key (in the given order)
# reaching it; then the shards of the scanned tables not held by exactly one placement in
# one of those groups (a shard moved to a node no key reaches yet, or a move in progress),
# out of all; then the scanned tables not distributed in workflow_runs' co-location group:
# a node scan joins each runs shard to the other tables' shards of the same range, and a
# table distributed otherwise (another shard count, not distributed) would leave out its
# shards, and with them every candidate of those runs, without an error.
_COVERAGE = """
    WITH keyed AS (
        SELECT DISTINCT ON (p.groupid) p.groupid, k.key, k.n
          FROM unnest(%(keys)s::text[]) WITH ORDINALITY AS k(key, n)
          JOIN pg_dist_placement p ON p.shardid = get_shard_id_for_distribution_column('task_outbox', k.key)
         ORDER BY p.groupid, k.n
    ), shards AS (
        SELECT s.shardid, count(p.placementid) AS placements,
               COALESCE(bool_and(p.groupid IN (SELECT groupid FROM keyed)), false) AS reached
          FROM pg_dist_shard s LEFT JOIN pg_dist_placement p ON p.shardid = s.shardid
         WHERE s.logicalrelid = ANY(%(tables)s::regclass[])
         GROUP BY s.shardid)
    SELECT ARRAY(SELECT key FROM keyed GROUP BY key ORDER BY min(n)),
           count(*) FILTER (WHERE placements <> 1 OR NOT reached), count(*),
           ARRAY(SELECT t.name FROM unnest(%(tables)s::text[]) AS t(name)
                  WHERE NOT EXISTS (SELECT 1 FROM pg_dist_partition p, pg_dist_partition r
                                     WHERE p.logicalrelid = t.name::regclass
                                       AND r.logicalrelid = 'workflow_runs'::regclass
                                       AND p.colocationid = r.colocationid)
                  ORDER BY t.name)
      FROM shards"""


@dataclass(frozen=True, kw_only=True)
class Coverage:
    """What a set of stream keys reaches: ``keys``, one per worker node (the first of the
    keys given that reaches it: two keys whose shards a move put on one node would scan
    it twice), and ``why`` not every shard, in words (None: every shard, each once)."""

    keys: list[str]
    why: str | None


def covered(conn: Conn, keys: Sequence[str]) -> Coverage:
    """The nodes ``keys`` reach, one key each, and whether they hold every shard of
    :data:`SCANNED_TABLES`, each shard once, those tables all co-located with
    ``workflow_runs``. Reads the coordinator's metadata only."""
    if not keys:
        return Coverage(keys=[], why="no stream keys")
    row = conn.execute(_COVERAGE, {"keys": list(keys), "tables": list(SCANNED_TABLES)}).fetchone()
    nodes, missing, total, apart = (list(row[0]), int(row[1]), int(row[2]), list(row[3])) if row else ([], 0, 0, [])
    if apart:
        return Coverage(keys=[], why=f"{', '.join(apart)} not co-located with workflow_runs")
    if total == 0:
        return Coverage(keys=nodes, why="no shards found")
    if missing:
        return Coverage(keys=nodes, why=f"{missing} of {total} shards are on no node a stream key reaches, "
                                        "or on more than one")
    return Coverage(keys=nodes, why=None)


def prune_webhooks_on_node(conn: Conn, key: str, keep_s: float, limit: int) -> int:
    """:func:`composer_ops.repo.webhooks.prune` on the node ``key`` hashes to: up to
    ``limit`` of its deliveries finished more than ``keep_s`` seconds ago, deleted in
    one delegated call, a one-phase transaction of that node (in autocommit)."""
    row = conn.execute("SELECT composer_prune_webhooks_node(%s, %s, %s)", (key, keep_s, limit)).fetchone()
    return int(row[0]) if row and row[0] is not None else 0
