"""The coordinator's scans on Citus, one call per worker node.

On a single server, and on Citus when the nodes do not cover every shard, the timers,
the lease sweeper and the start timeouts read their candidates with the statements of
:func:`composer_ops.repo.signals.due_waits`, :func:`composer_ops.repo.tasks.expired_leases`
and :func:`composer_ops.repo.outbox.unstarted`; on Citus each of those runs over every
shard through the coordinator. :func:`scan_node` asks one node instead:
``composer_scan_node`` (sql/citus/R__scan_node.sql), delegated to the node a stream key
hashes to (:func:`composer_ops.repo.citus.stream_keys`), reads that node's shards with
the same predicates and returns the three kinds of candidates. :func:`covered` says
whether the nodes of a set of keys hold every shard, the condition for the node scans
to see what the statements would. :func:`prune_webhooks_on_node` is the webhook prune
of one node, a local one-phase transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from psycopg.rows import dict_row

from composer_ops.repo._base import Conn
from composer_ops.repo.rows import DueWait, ExpiredLease, Unstarted

#: The kinds a node scan reads: due timers, expired leases, unstarted dispatches.
KINDS = ("timer", "lease", "start")

#: The distributed tables whose shards the node scans and the node prune read.
SCANNED_TABLES = ("workflow_runs", "task_instances", "task_outbox", "webhook_deliveries")


@dataclass
class NodeScan:
    """Candidates found by node scans: each list in the single server's order."""

    timers: list[DueWait] = field(default_factory=list)
    leases: list[ExpiredLease] = field(default_factory=list)
    starts: list[Unstarted] = field(default_factory=list)


_SCAN = "SELECT * FROM composer_scan_node(%s, %s, %s, %s, %s, %s, %s, %s, %s)"


def scan_node(conn: Conn, key: str, *, now: datetime, floor: str, limit: int, kinds: Sequence[str],
              ceiling: str | None = None, skip_timers: Sequence[str] = (), skip_leases: Sequence[str] = (),
              skip_starts: Sequence[str] = ()) -> list[tuple[datetime, DueWait | ExpiredLease | Unstarted]]:
    """Up to ``limit`` candidates of each of ``kinds`` on the node ``key`` hashes to, each
    with its sort time (wake-up, lease expiry, start deadline): one statement, delegated
    to that node, in autocommit. ``now`` is the coordinator's clock, ``floor`` the active
    floor, ``ceiling`` the active ceiling (:func:`composer_ops.core.runids.active_ceiling`;
    None: none), the ``skip_*`` keys those of the statements they replace."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(_SCAN, (key, now, floor, ceiling, limit, list(kinds), list(skip_timers), list(skip_leases),
                                   list(skip_starts)), prepare=False).fetchall()
    found: list[tuple[datetime, DueWait | ExpiredLease | Unstarted]] = []
    for r in rows:
        if r["kind"] == "timer":
            found.append((r["at"], DueWait(run_id=r["run_id"], task_id=r["task_id"], node_id=r["node_id"])))
        elif r["kind"] == "lease":
            found.append((r["at"], ExpiredLease(run_id=r["run_id"], task_id=r["task_id"], node_id=r["node_id"],
                                                attempt=r["attempt"], lease_owner=r["lease_owner"],
                                                timed_out=bool(r["timed_out"]))))
        else:
            found.append((r["at"], Unstarted(run_id=r["run_id"], task_id=r["task_id"], attempt=r["attempt"])))
    return found


def merge(found: Sequence[tuple[datetime, DueWait | ExpiredLease | Unstarted]], limit: int) -> NodeScan:
    """The candidates of several nodes as one :class:`NodeScan`: per kind, the ``limit``
    first by sort time (each node returned its own first ``limit``)."""
    ordered = sorted(found, key=lambda pair: pair[0])
    scan = NodeScan()
    scan.timers = [c for _, c in ordered if isinstance(c, DueWait)][:limit]
    scan.leases = [c for _, c in ordered if isinstance(c, ExpiredLease)][:limit]
    scan.starts = [c for _, c in ordered if isinstance(c, Unstarted)][:limit]
    return scan


# Shards of the scanned tables not held by exactly one placement in a group of the keys'
# nodes (a shard moved to a node no key reaches yet, or a move in progress), out of all.
_COVERAGE = """
    WITH keyed AS (
        SELECT DISTINCT p.groupid
          FROM unnest(%(keys)s::text[]) AS k(key)
          JOIN pg_dist_placement p ON p.shardid = get_shard_id_for_distribution_column('task_outbox', k.key)
    ), shards AS (
        SELECT s.shardid, count(p.placementid) AS placements,
               COALESCE(bool_and(p.groupid IN (SELECT groupid FROM keyed)), false) AS reached
          FROM pg_dist_shard s LEFT JOIN pg_dist_placement p ON p.shardid = s.shardid
         WHERE s.logicalrelid = ANY(%(tables)s::regclass[])
         GROUP BY s.shardid)
    SELECT count(*) FILTER (WHERE placements <> 1 OR NOT reached), count(*) FROM shards"""


def covered(conn: Conn, keys: Sequence[str]) -> str | None:
    """None when the nodes of ``keys`` hold every shard of :data:`SCANNED_TABLES`, each
    shard once; else why not, in words. Reads the coordinator's metadata only."""
    if not keys:
        return "no stream keys"
    row = conn.execute(_COVERAGE, {"keys": list(keys), "tables": list(SCANNED_TABLES)}).fetchone()
    missing, total = (int(row[0]), int(row[1])) if row else (0, 0)
    if total == 0:
        return "no shards found"
    if missing:
        return f"{missing} of {total} shards are on no node a stream key reaches, or on more than one"
    return None


def prune_webhooks_on_node(conn: Conn, key: str, keep_s: float, limit: int) -> int:
    """:func:`composer_ops.repo.webhooks.prune` on the node ``key`` hashes to: up to
    ``limit`` of its deliveries finished more than ``keep_s`` seconds ago, deleted in
    one delegated call, a one-phase transaction of that node (in autocommit)."""
    row = conn.execute("SELECT composer_prune_webhooks_node(%s, %s, %s)", (key, keep_s, limit)).fetchone()
    return int(row[0]) if row and row[0] is not None else 0
