"""The coordinator's pass on Citus: one scan per worker node, one prune per node.

The timers, the start timeouts, the lease sweeper, the children loop and the webhook
relay read their candidates with one ``composer_scan_node`` call per worker node
(sql/citus/R__scan_node.sql), delegated to the node; the webhook prune deletes with
one ``composer_prune_webhooks_node`` call per node. Each is a local transaction of its
node: no two-phase commit. When the nodes do not cover every shard the pass falls back
to the statements over every shard; a node down is logged and backed off, and the
other nodes go on."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from composer_ops import Engine
from composer_ops.db import autocommit
from composer_ops.engine import childrows
from composer_ops.engine.coordinator import Coordinator, PassStats
from composer_ops.engine.ids import uuid7_text
from composer_ops.errors import NotDelegated
from composer_ops.repo import citus_scan, clock, deliveries, outbox, signals, tasks, webhooks
from composer_ops.testing.citus import CitusCluster
from tests.receiver import Receiver

WAITS = {"id": "sn-wait", "nodes": [{"id": "w", "type": "WAIT", "duration_s": 3600}]}
LEASED = {"id": "sn-lease", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "snl",
                                       "retry": {"max_attempts": 3, "initial_backoff_s": 0}}]}
UNSTARTED = {"id": "sn-start", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "sns",
                                          "timeouts": {"schedule_to_start_s": 3600}}]}
HOOKED = {"id": "sn-hook", "webhook_url": "http://127.0.0.1:9/never",
          "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "snh"}]}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=4) as e:
        for spec in (WAITS, LEASED, UNSTARTED, HOOKED):
            e.deploy(spec)
        yield e


def _ids_per_node(db_url: str, per_node: int) -> dict[int, list[str]]:
    """Fresh run IDs, ``per_node`` for each worker node (by the group holding its shard)."""
    found: dict[int, list[str]] = {}
    with psycopg.connect(db_url, autocommit=True) as conn:
        groups = [int(r[0]) for r in conn.execute(
            "SELECT DISTINCT groupid FROM pg_dist_placement p JOIN pg_dist_shard s USING (shardid) "
            "WHERE s.logicalrelid = 'workflow_runs'::regclass").fetchall()]
        while any(len(found.get(g, [])) < per_node for g in groups):
            run_id = uuid7_text()
            row = conn.execute("SELECT groupid FROM pg_dist_placement WHERE shardid = "
                               "get_shard_id_for_distribution_column('workflow_runs', %s::text)", (run_id,)).fetchone()
            assert row is not None
            if len(found.setdefault(int(row[0]), [])) < per_node:
                found[int(row[0])].append(run_id)
    return found


def _candidates_on_every_node(db_url: str, engine: Engine) -> dict[int, dict[str, str]]:
    """On each worker node: a run with a due timer, one with an expired lease and one
    whose dispatch is past its schedule_to_start deadline."""
    placed: dict[int, dict[str, str]] = {}
    for group, (timer, lease, start) in _ids_per_node(db_url, 3).items():
        engine.start("sn-wait", run_id=timer)
        engine.start("sn-lease", run_id=lease)
        engine.start("sn-start", run_id=start)
        placed[group] = {"timer": timer, "lease": lease, "start": start}
    leased = [run for p in placed.values() for run in [p["lease"]]]
    assert {c.run_id for c in engine.claim(["snl"], "w", 10)} == set(leased)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE task_instances SET wake_at = now() - interval '1 minute' WHERE run_id = ANY(%s)",
                     ([p["timer"] for p in placed.values()],))
        conn.execute("UPDATE task_instances SET lease_expires_at = now() - interval '1 minute' "
                     "WHERE run_id = ANY(%s)", (leased,))
        conn.execute("UPDATE task_outbox SET start_by = now() - interval '1 minute' WHERE run_id = ANY(%s)",
                     ([p["start"] for p in placed.values()],))
    return placed


def _two_phase_commits_during(db_url: str, action: Callable[[], Any]) -> tuple[int, Any]:
    """Two-phase commits Citus recorded (``pg_dist_transaction`` rows) while ``action`` ran."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        before = [r[0] for r in conn.execute("SELECT gid FROM pg_dist_transaction").fetchall()]
        result = action()
        row = conn.execute("SELECT count(*) FROM pg_dist_transaction WHERE gid <> ALL(%s)", (before,)).fetchone()
    return (int(row[0]) if row else -1), result


def _no_statements_over_every_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_: Any, **__: Any) -> Any:
        raise AssertionError("a statement over every shard ran in a pass with node scans")

    for module, name in ((signals, "due_waits"), (tasks, "expired_leases"), (outbox, "unstarted")):
        monkeypatch.setattr(module, name, refused)


def test_one_pass_finds_a_due_timer_an_expired_lease_and_an_unstarted_dispatch_on_each_node(
        db_url: str, engine: Engine, citus_cluster: CitusCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    placed = _candidates_on_every_node(db_url, engine)
    assert len(placed) == len(citus_cluster.workers)
    # What the node scans find is what the statements over every shard find.
    with engine.pool.connection() as conn:
        conn.autocommit = True
        now, keys = clock.now(conn), engine.stream_keys(conn)
        assert citus_scan.covered(conn, keys).why is None
        found = citus_scan.merge([c for key in keys for c in citus_scan.scan_node(
            conn, key, now=now, floor="", limit=100, kinds=citus_scan.KINDS)], 100)
        assert sorted(found.timers, key=str) == sorted(signals.due_waits(conn, 100, now=now), key=str)
        assert sorted(found.leases, key=str) == sorted(tasks.expired_leases(conn, 100, now=now), key=str)
        assert sorted(found.starts, key=str) == sorted(outbox.unstarted(conn, 100, now=now), key=str)
    _no_statements_over_every_shard(monkeypatch)
    coordinator = engine.coordinator(batch=10)
    prepared, stats = _two_phase_commits_during(db_url, lambda: coordinator.run_once(["timers", "leases"]))
    nodes = len(citus_cluster.workers)
    assert (stats.timers_fired, stats.leases_expired, stats.start_timeouts) == (nodes, nodes, nodes), stats
    assert (stats.node_scans, stats.node_scans_failed, stats.scans_through_coordinator, stats.errors) == (
        nodes, 0, False, [])
    assert prepared == 0
    for p in placed.values():
        assert engine.get_run(p["timer"]).status == "SUCCEEDED"
        lease = engine.get_run(p["lease"]).tasks[0]
        assert (lease.state, lease.attempt) == ("PENDING", 1)
        assert engine.get_run(p["start"]).status == "FAILED"


def test_a_pass_whose_nodes_do_not_cover_every_shard_scans_through_the_coordinator(
        db_url: str, engine: Engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    placed = _candidates_on_every_node(db_url, engine)
    coordinator = engine.coordinator(batch=10)
    with engine.pool.connection() as conn:
        one = engine.stream_keys(conn)[:1]              # as if a node had just been given shards
    monkeypatch.setattr(engine, "stream_keys", lambda conn, fresh=False: one)
    with caplog.at_level(logging.WARNING, logger="composer_ops.engine.coordinator"):
        stats = coordinator.run_once(["timers", "leases"])
    assert stats.scans_through_coordinator and stats.node_scans == 0 and stats.errors == []
    assert (stats.timers_fired, stats.leases_expired, stats.start_timeouts) == (len(placed),) * 3
    assert any("do not cover every shard" in r.getMessage() for r in caplog.records)


def _passes_until(coordinator: Coordinator, done: Callable[[PassStats], bool], timeout: float = 60.0
                  ) -> list[PassStats]:
    seen: list[PassStats] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.append(coordinator.run_once(["timers", "leases"]))
        if done(seen[-1]):
            return seen
        time.sleep(0.2)
    raise AssertionError(f"not done after {timeout}s: {seen[-3:]}")


@pytest.mark.timeout(180)
def test_a_pass_with_a_node_down_logs_it_and_goes_on_with_the_other_nodes(
        db_url: str, engine: Engine, citus_cluster: CitusCluster, caplog: pytest.LogCaptureFixture) -> None:
    placed = _candidates_on_every_node(db_url, engine)
    down = citus_cluster.workers[-1]
    with psycopg.connect(db_url) as conn:
        groups: dict[int, int] = dict(conn.execute("SELECT nodeport, groupid FROM pg_dist_node").fetchall())
    assert down.port is not None
    lost = placed[groups[down.port]]
    live = [p for g, p in placed.items() if g != groups[down.port]]
    coordinator = engine.coordinator(batch=10, event_lock_wait_s=0.5)
    with caplog.at_level(logging.WARNING, logger="composer_ops.engine.coordinator"), down.down("immediate"):
        stats = coordinator.run_once(["timers", "leases"])
    assert stats.node_scans_failed == 1 and stats.node_scans == len(live), stats
    assert (stats.timers_fired, stats.leases_expired, stats.start_timeouts) == (len(live),) * 3, stats
    assert any("failed, backing it off" in r.getMessage() for r in caplog.records)
    for p in live:
        assert engine.get_run(p["timer"]).status == "SUCCEEDED"
    # Back up: a later pass (after the node's backoff) finds its candidates; nothing was lost.
    later = _passes_until(coordinator, lambda s: s.timers_fired > 0 and s.node_scans_failed == 0)
    fired = sum(s.timers_fired for s in later)
    expired = sum(s.leases_expired for s in later)
    timed_out = sum(s.start_timeouts for s in later)
    assert (fired, expired, timed_out) == (1, 1, 1), later
    assert engine.get_run(lost["timer"]).status == "SUCCEEDED"
    assert engine.get_run(lost["start"]).status == "FAILED"
    lease = engine.get_run(lost["lease"]).tasks[0]
    assert (lease.state, lease.attempt) == ("PENDING", 1)


def test_the_webhook_prune_deletes_node_by_node_in_one_phase(db_url: str, engine: Engine,
                                                             citus_cluster: CitusCluster) -> None:
    runs = [run for ids in _ids_per_node(db_url, 3).values() for run in ids]
    for run_id in runs:
        engine.start("sn-hook", run_id=run_id)
    for claim in engine.claim(["snh"], "w", len(runs)):
        engine.complete(claim, None)
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM webhook_deliveries").fetchone() == (len(runs),)
        kept = runs[0]
        conn.execute("UPDATE webhook_deliveries SET gave_up_at = now() - interval '8 days' WHERE run_id <> %s",
                     (kept,))
    coordinator = engine.coordinator(webhook_keep_days=7)
    stats = PassStats()
    prepared, _ = _two_phase_commits_during(db_url, lambda: coordinator._prune_webhooks(stats, batch=2,
                                                                                        max_batches=1))
    assert prepared == 0
    assert stats.webhooks_pruned == 2 * len(citus_cluster.workers) and stats.errors == []  # a batch per node
    coordinator._prune_webhooks(stats, batch=2, max_batches=1)                               # due again at once
    assert stats.webhooks_pruned == len(runs) - 1
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT run_id FROM webhook_deliveries").fetchall() == [(kept,)]


def _group_of(conn: Any, key: str) -> int:
    row = conn.execute("SELECT groupid FROM pg_dist_placement WHERE shardid = "
                       "get_shard_id_for_distribution_column('workflow_runs', %s::text)", (key,)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_node_scan_or_prune_citus_does_not_delegate_fails_instead_of_finding_nothing(
        db_url: str, engine: Engine) -> None:
    """In a transaction block Citus does not delegate a distributed function: the call ran
    on the coordinator, whose group holds none of the node's shards, and found nothing."""
    _candidates_on_every_node(db_url, engine)
    with engine.pool.connection() as conn, autocommit(conn):
        now = clock.now(conn)
        for key in engine.stream_keys(conn):
            assert len(citus_scan.scan_node(conn, key, now=now, floor="", limit=10, kinds=citus_scan.KINDS)) == 3
            with pytest.raises(NotDelegated, match=r"composer_scan_node\('stream-\d+'\) ran on node group 0"), \
                    conn.transaction():
                citus_scan.scan_node(conn, key, now=now, floor="", limit=10, kinds=citus_scan.KINDS)
            with pytest.raises(NotDelegated, match=r"composer_prune_webhooks_node\('stream-\d+'\)"), \
                    conn.transaction():
                citus_scan.prune_webhooks_on_node(conn, key, 0.0, 10)


@pytest.mark.timeout(180)
def test_a_pass_whose_node_scan_is_not_delegated_logs_it_once_and_scans_through_the_coordinator(
        db_url: str, engine: Engine, citus_cluster: CitusCluster, caplog: pytest.LogCaptureFixture) -> None:
    """A worker node whose metadata is not synced is not delegated to: its scan raises
    (an error about our call, not about reaching the node), which backs off no node,
    is logged once with its traceback, and this pass scans every shard through the
    coordinator, finding every node's candidates."""
    placed = _candidates_on_every_node(db_url, engine)
    worker = citus_cluster.workers[-1]
    coordinator = engine.coordinator(batch=10)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SELECT stop_metadata_sync_to_node('127.0.0.1', %s)", (worker.port,))
        try:
            with caplog.at_level(logging.DEBUG, logger="composer_ops.engine.coordinator"):
                first = coordinator.run_once(["timers", "leases"])
                second = coordinator.run_once(["timers", "leases"])
        finally:
            conn.execute("SELECT start_metadata_sync_to_node('127.0.0.1', %s)", (worker.port,))
    assert (first.timers_fired, first.leases_expired, first.start_timeouts) == (len(placed),) * 3, first
    assert first.scans_through_coordinator and first.node_errors == 1 and first.node_scans_failed == 0, first
    assert any("ran on node group 0" in e for e in first.errors), first.errors
    assert second.node_errors == 1 and second.node_scans_failed == 0, second
    assert coordinator._node_backoff.skipped() == []
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1 and logged[0].exc_info is not None, [r.getMessage() for r in logged]
    assert "not about reaching the node" in logged[0].getMessage()
    for p in placed.values():
        assert engine.get_run(p["timer"]).status == "SUCCEEDED"
        assert engine.get_run(p["start"]).status == "FAILED"
    # Delegated again: one scan per node, and it says so.
    with caplog.at_level(logging.INFO, logger="composer_ops.engine.coordinator"):
        again = coordinator.run_once(["timers", "leases"])
    assert (again.node_scans, again.node_errors, again.scans_through_coordinator) == (
        len(citus_cluster.workers), 0, False), again
    assert any("scans succeed again" in r.getMessage() for r in caplog.records)


def test_a_bug_in_one_node_scan_backs_off_no_node(db_url: str, engine: Engine, citus_cluster: CitusCluster,
                                                  caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an error about reaching a node (Unavailable) backs the node off; a bug is
    counted and logged with its traceback, and the pass scans through the coordinator."""
    placed = _candidates_on_every_node(db_url, engine)
    real = citus_scan.scan_node
    with engine.pool.connection() as conn:
        broken = engine.stream_keys(conn)[-1]

    def buggy(conn: Any, key: str, **kwargs: Any) -> Any:
        if key == broken:
            raise KeyError("a bug")
        return real(conn, key, **kwargs)

    monkeypatch.setattr(citus_scan, "scan_node", buggy)
    coordinator = engine.coordinator(batch=10)
    with caplog.at_level(logging.WARNING, logger="composer_ops.engine.coordinator"):
        stats = coordinator.run_once(["timers", "leases"])
    assert (stats.node_errors, stats.node_scans_failed, stats.scans_through_coordinator) == (1, 0, True), stats
    assert (stats.timers_fired, stats.leases_expired, stats.start_timeouts) == (len(placed),) * 3, stats
    assert coordinator._node_backoff.skipped() == []
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [KeyError]


def test_two_stream_keys_on_one_node_scan_it_once(db_url: str, engine: Engine, citus_cluster: CitusCluster,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys found before a shard move can reach one node twice: the node is scanned
    once, so each candidate is found once."""
    placed = _candidates_on_every_node(db_url, engine)
    with engine.pool.connection() as conn, autocommit(conn):
        keys = engine.stream_keys(conn)
        home = _group_of(conn, keys[0])
        twin = next(f"stream-{i}" for i in range(10_000)
                    if f"stream-{i}" not in keys and _group_of(conn, f"stream-{i}") == home)
    monkeypatch.setattr(engine, "stream_keys", lambda conn, fresh=False: [*keys, twin])
    coordinator = engine.coordinator(batch=10)
    with engine.pool.connection() as conn, autocommit(conn):
        stats = PassStats()
        scan = coordinator._node_scan(conn, stats)
    assert scan is not None and stats.node_scans == len(citus_cluster.workers)
    assert sorted(w.run_id for w in scan.timers) == sorted(p["timer"] for p in placed.values())
    assert sorted(lease.run_id for lease in scan.leases) == sorted(p["lease"] for p in placed.values())
    assert sorted(s.run_id for s in scan.starts) == sorted(p["start"] for p in placed.values())
    stats = coordinator.run_once(["timers", "leases"])
    assert (stats.timers_fired, stats.leases_expired, stats.start_timeouts, stats.stale) == (len(placed),) * 3 + (0,)
    with engine.pool.connection() as conn, autocommit(conn):
        assert citus_scan.covered(conn, [twin, *keys]).keys == [twin, *keys[1:]]


def _refuse_deletes_on(node_url: str, table: str) -> Callable[[], None]:
    """Make every DELETE on the node's shards of ``table`` fail (a trigger on each, made
    on that node only); returns what undoes it."""
    with psycopg.connect(node_url, autocommit=True) as conn:
        conn.execute("SET citus.enable_ddl_propagation TO off")
        conn.execute("SET citus.enable_manual_changes_to_shards TO on")
        conn.execute("CREATE FUNCTION test_refuse_delete() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$ BEGIN RAISE EXCEPTION 'deletes refused on this node'; END $$")
        shards = [str(r[0]) for r in conn.execute(
            "SELECT shard_name(%s::regclass, s.shardid) FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) "
            "WHERE s.logicalrelid = %s::regclass AND p.groupid = (SELECT groupid FROM pg_dist_local_group)",
            (table, table)).fetchall()]
        for shard in shards:
            conn.execute(sql.SQL("CREATE TRIGGER test_refuse BEFORE DELETE ON {} FOR EACH STATEMENT "
                                 "EXECUTE FUNCTION test_refuse_delete()").format(sql.Identifier(shard)))

    def undo() -> None:
        with psycopg.connect(node_url, autocommit=True) as conn:
            conn.execute("SET citus.enable_ddl_propagation TO off")
            conn.execute("DROP FUNCTION test_refuse_delete() CASCADE")

    return undo


@pytest.mark.timeout(120)
def test_a_node_whose_webhook_prune_fails_is_backed_off_for_the_prune_only(
        db_url: str, engine: Engine, citus_cluster: CitusCluster) -> None:
    runs = [run for ids in _ids_per_node(db_url, 2).values() for run in ids]
    for run_id in runs:
        engine.start("sn-hook", run_id=run_id)
    for claim in engine.claim(["snh"], "w", len(runs)):
        engine.complete(claim, None)
    placed = _candidates_on_every_node(db_url, engine)
    worker = citus_cluster.workers[-1]
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE webhook_deliveries SET gave_up_at = now() - interval '8 days'")
        groups: dict[int, int] = dict(conn.execute("SELECT nodeport, groupid FROM pg_dist_node").fetchall())
        assert worker.port is not None
        group = groups[worker.port]
        kept = [r for r in runs if _group_of(conn, r) == group]
        name = conn.info.dbname
    with engine.pool.connection() as conn, autocommit(conn):
        failing = next(k for k in engine.stream_keys(conn) if _group_of(conn, k) == group)
    undo = _refuse_deletes_on(worker.url(name), "webhook_deliveries")
    try:
        coordinator = engine.coordinator(webhook_keep_days=7, batch=10)
        stats = PassStats()
        coordinator._prune_webhooks(stats)
        assert stats.node_scans_failed == 1 and stats.webhooks_pruned == len(runs) - len(kept), stats
        assert any("webhook prune" in e and "deletes refused" in e for e in stats.errors), stats.errors
        assert coordinator._prune_backoff.skipped() == [failing]
        # The node's scans go on: its timer fires, its lease expires, its late start fails.
        scans = coordinator.run_once(["timers", "leases"])
        assert (scans.node_scans, scans.node_scans_failed, scans.errors) == (len(citus_cluster.workers), 0, []), scans
        assert (scans.timers_fired, scans.leases_expired, scans.start_timeouts) == (len(placed),) * 3, scans
        assert coordinator._node_backoff.skipped() == []
        # Still backed off: the next prune does not call it.
        again = PassStats()
        coordinator._prune_webhooks(again)
        assert (again.node_scans_failed, again.webhooks_pruned, again.errors) == (0, 0, []), again
    finally:
        undo()
    deadline = time.monotonic() + 30
    while coordinator._prune_backoff.skipped() and time.monotonic() < deadline:
        time.sleep(0.1)
    done = PassStats()
    coordinator._prune_webhooks(done)
    assert (done.webhooks_pruned, done.errors) == (len(kept), []), done
    assert coordinator._prune_backoff.skipped() == []


def _move(conn: Any, shard: int, source: int, target: int) -> None:
    """Move ``shard`` (with its co-located shards) from group ``source`` to ``target``,
    blocking writes, and drop what the move left behind on the source."""
    nodes = dict((int(g), (str(h), int(p))) for g, h, p in conn.execute(
        "SELECT groupid, nodename, nodeport FROM pg_dist_node WHERE groupid IN (%s, %s)", (source, target)).fetchall())
    conn.execute("SELECT citus_move_shard_placement(%s, %s, %s, %s, %s, shard_transfer_mode => 'block_writes')",
                 (shard, *nodes[source], *nodes[target]))
    conn.execute("CALL citus_cleanup_orphaned_resources()")


@pytest.mark.timeout(300)
def test_a_node_scan_keeps_one_statement_per_shard_and_kind_across_shard_moves(
        db_url: str, engine: Engine, citus_cluster: CitusCluster) -> None:
    """The node scan prepares its statements once per session (planned once, not at
    every pass): a shard moved away and back between two scans of one session is read
    again (its table made anew under its name), the statements of a shard moved away are
    deallocated, and a session keeps three per shard of its node."""
    placed = _candidates_on_every_node(db_url, engine)
    dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    worker = citus_cluster.workers[0]
    with psycopg.connect(worker.url(str(dbname)), autocommit=True) as node, \
            psycopg.connect(db_url, autocommit=True) as coordinator:
        row = node.execute("SELECT groupid FROM pg_dist_local_group").fetchone()
        assert row is not None
        group = int(row[0])
        other = next(g for g in placed if g != group)
        moved_run = placed[group]["timer"]

        def shard_of(key: str) -> int:
            row = coordinator.execute("SELECT get_shard_id_for_distribution_column('workflow_runs', %s::text)",
                                      (key,)).fetchone()
            assert row is not None
            return int(row[0])

        shard = shard_of(moved_run)
        # A key of this node whose shard stays here (the call goes where its key's shard is).
        key = next(k for k in (f"stream-{i}" for i in range(10_000))
                   if _group_of(coordinator, k) == group and shard_of(k) != shard)

        def scan() -> set[str]:
            now = clock.now(node)
            return {c.run_id for _, c in citus_scan.scan_node(node, key, now=now, floor="", limit=10,
                                                              kinds=citus_scan.KINDS)}

        def statements() -> int:
            row = node.execute("SELECT count(*) FROM pg_prepared_statements "
                               "WHERE name LIKE 'composer\\_scan\\_%%'").fetchone()
            return int(row[0]) if row else -1

        def shards_here() -> int:
            row = coordinator.execute("SELECT count(*) FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) "
                                      "WHERE s.logicalrelid = 'workflow_runs'::regclass AND p.groupid = %s",
                                      (group,)).fetchone()
            return int(row[0]) if row else -1

        def here() -> set[str]:
            return {r for r in placed[group].values() if _group_of(coordinator, r) == group}

        everything = set(placed[group].values())
        assert scan() == everything
        assert statements() == 3 * shards_here()
        assert scan() == everything
        row = node.execute("SELECT sum(custom_plans), min(generic_plans), max(generic_plans) "
                           "FROM pg_prepared_statements WHERE name LIKE 'composer\\_scan\\_%%'").fetchone()
        assert row is not None and tuple(int(x) for x in row) == (0, 2, 2)      # the generic plan, kept
        _move(coordinator, shard, group, other)     # away and back, no scan in between
        _move(coordinator, shard, other, group)
        assert scan() == everything
        assert statements() == 3 * shards_here()
        _move(coordinator, shard, group, other)
        assert moved_run not in here()
        assert scan() == here()
        assert statements() == 3 * shards_here()
        _move(coordinator, shard, other, group)
        assert scan() == everything
        assert statements() == 3 * shards_here()


CHILD = {"id": "sn-child", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "snc"}]}
PARENT = {"id": "sn-parent", "nodes": [{"id": "call", "type": "SUB_WORKFLOW", "workflow": "sn-child"}]}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(lambda request, body: 204)
    yield r
    r.close()


def _child_rows_and_due_webhooks_on_every_node(db_url: str, engine: Engine, url: str,
                                               monkeypatch: pytest.MonkeyPatch) -> dict[int, dict[str, str]]:
    """On each worker node: a parent whose child's start is a pending row (no engine
    delivers it after its commit), a run whose webhook delivery is due, one whose next
    attempt is an hour ahead and one whose delivery was delivered (neither of which is due)."""
    monkeypatch.setattr(childrows, "drain", lambda shell: 0)
    engine.deploy(CHILD)
    engine.deploy(PARENT)
    engine.deploy({"id": "sn-hook-ok", "webhook_url": url,
                   "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "sno"}]})
    placed: dict[int, dict[str, str]] = {}
    for group, (parent, due, later, done) in _ids_per_node(db_url, 4).items():
        engine.start("sn-parent", run_id=parent)
        for run_id in (due, later, done):
            engine.start("sn-hook-ok", run_id=run_id)
        placed[group] = {"parent": parent, "due": due, "later": later, "done": done}
    claims = engine.claim(["sno"], "w", 3 * len(placed))
    assert len(claims) == 3 * len(placed)
    for claimed in claims:
        engine.complete(claimed, None)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE webhook_deliveries SET next_attempt_at = now() + interval '1 hour' WHERE run_id = ANY(%s)",
                     ([p["later"] for p in placed.values()],))
        conn.execute("UPDATE webhook_deliveries SET delivered_at = now() WHERE run_id = ANY(%s)",
                     ([p["done"] for p in placed.values()],))
        assert sorted(str(r[0]) for r in conn.execute("SELECT run_id FROM child_deliveries").fetchall()) == sorted(
            p["parent"] for p in placed.values())
    return placed


def test_the_node_scans_find_the_child_rows_and_due_webhooks_the_statements_find(
        db_url: str, engine: Engine, citus_cluster: CitusCluster, receiver: Receiver,
        monkeypatch: pytest.MonkeyPatch) -> None:
    placed = _child_rows_and_due_webhooks_on_every_node(db_url, engine, receiver.url("/ok"), monkeypatch)
    assert len(placed) == len(citus_cluster.workers)
    with engine.pool.connection() as conn, autocommit(conn):
        now, keys = clock.now(conn), engine.stream_keys(conn)
        assert citus_scan.covered(conn, keys).why is None

        def scan(skip_children: list[str]) -> citus_scan.NodeScan:
            return citus_scan.merge([c for key in keys for c in citus_scan.scan_node(
                conn, key, now=now, floor="", limit=100, kinds=("child", "webhook"),
                skip_children=skip_children)], 100)

        found = scan([])
        assert (found.timers, found.leases, found.starts) == ([], [], [])
        assert sorted(c.key for c in found.children) == sorted(deliveries.pending(conn, 100))
        assert sorted(c.run_id for c in found.children) == sorted(p["parent"] for p in placed.values())
        assert sorted(found.webhooks, key=str) == sorted(webhooks.due(conn, 100), key=str)
        assert sorted(w.run_id for w in found.webhooks) == sorted(p["due"] for p in placed.values())
        # The children loop's backoff keys: skipped by both alike.
        skip = [deliveries.key_text(found.children[0].key)]
        assert sorted(c.key for c in scan(skip).children) == sorted(deliveries.pending(conn, 100, skip=skip))
        assert len(scan(skip).children) == len(placed) - 1


def _no_delivery_reads_over_every_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_: Any, **__: Any) -> Any:
        raise AssertionError("a statement over every shard ran in a pass with node scans")

    for module, name in ((deliveries, "pending"), (webhooks, "due")):
        monkeypatch.setattr(module, name, refused)


def test_one_pass_delivers_the_child_rows_and_due_webhooks_of_every_node_with_one_scan_per_node(
        db_url: str, engine: Engine, citus_cluster: CitusCluster, receiver: Receiver,
        monkeypatch: pytest.MonkeyPatch) -> None:
    placed = _child_rows_and_due_webhooks_on_every_node(db_url, engine, receiver.url("/ok"), monkeypatch)
    _no_statements_over_every_shard(monkeypatch)
    _no_delivery_reads_over_every_shard(monkeypatch)
    coordinator = engine.coordinator(batch=10, webhook_keep_days=None)
    stats = coordinator.run_once(["children", "timers", "leases", "webhooks"])
    nodes = len(citus_cluster.workers)
    assert (stats.children_delivered, stats.webhooks_delivered, stats.webhooks_failed) == (nodes, nodes, 0), stats
    assert (stats.node_scans, stats.node_scans_failed, stats.scans_through_coordinator, stats.errors) == (
        nodes, 0, False, [])
    assert sorted(json.loads(body)["run_id"] for _, body, _ in receiver.requests) == sorted(
        p["due"] for p in placed.values())
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM child_deliveries").fetchone() == (0,)
    for p in placed.values():
        assert [c.id for c in engine.get_run(p["parent"]).children] != []
    # Nothing due any more: the next pass takes and posts nothing.
    again = coordinator.run_once(["children", "webhooks"])
    assert (again.children_delivered, again.webhooks_delivered, again.node_scans) == (0, 0, nodes), again
    assert len(receiver.requests) == nodes


def test_a_pass_whose_nodes_do_not_cover_every_shard_delivers_child_rows_and_webhooks_through_the_coordinator(
        db_url: str, engine: Engine, citus_cluster: CitusCluster, receiver: Receiver,
        monkeypatch: pytest.MonkeyPatch) -> None:
    placed = _child_rows_and_due_webhooks_on_every_node(db_url, engine, receiver.url("/ok"), monkeypatch)
    with engine.pool.connection() as conn:
        one = engine.stream_keys(conn)[:1]
    monkeypatch.setattr(engine, "stream_keys", lambda conn, fresh=False: one)
    stats = engine.coordinator(batch=10, webhook_keep_days=None).run_once(["children", "webhooks"])
    assert stats.scans_through_coordinator and stats.node_scans == 0 and stats.errors == [], stats
    assert (stats.children_delivered, stats.webhooks_delivered) == (len(placed), len(placed)), stats


def test_a_child_row_whose_delivery_fails_is_skipped_by_the_node_scans_while_backed_off(
        db_url: str, engine: Engine, citus_cluster: CitusCluster, receiver: Receiver,
        monkeypatch: pytest.MonkeyPatch) -> None:
    placed = _child_rows_and_due_webhooks_on_every_node(db_url, engine, receiver.url("/ok"), monkeypatch)
    failing = sorted(p["parent"] for p in placed.values())[0]
    real = childrows.deliver
    tried: list[str] = []

    def deliver(shell: Any, key: tuple[str, str]) -> bool:
        tried.append(key[0])
        if key[0] == failing:
            raise RuntimeError("this delivery fails")
        return real(shell, key)

    monkeypatch.setattr(childrows, "deliver", deliver)
    _no_delivery_reads_over_every_shard(monkeypatch)
    coordinator = engine.coordinator(batch=10)
    first = coordinator.run_once(["children"])
    assert first.children_delivered == len(placed) - 1 and first.node_scans == len(citus_cluster.workers), first
    assert any("this delivery fails" in e for e in first.errors), first.errors
    assert sorted(tried) == sorted(p["parent"] for p in placed.values())
    with psycopg.connect(db_url) as conn:
        (row,) = conn.execute("SELECT run_id, target_run_id FROM child_deliveries").fetchall()
    assert row[0] == failing
    # Missed again and again: skipped for a minute, which no pass below outlasts on a loaded machine.
    for _ in range(6):
        coordinator._child_backoff.failed(deliveries.key_text((str(row[0]), str(row[1]))))
    tried.clear()
    second = coordinator.run_once(["children"])
    assert (second.children_delivered, second.errors, second.node_scans, tried) == (
        0, [], len(citus_cluster.workers), []), second


def test_a_scanned_table_not_co_located_with_the_runs_is_not_covered(db_url: str, engine: Engine) -> None:
    """A node scan joins each runs shard to the other tables' shards of its range: a
    scanned table distributed apart from the runs would leave those shards, and every
    candidate of their runs, out of the scan without an error. The coverage check says
    so instead, and the pass reads through the coordinator."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        keys = engine.stream_keys(conn)
        assert citus_scan.covered(conn, keys).why is None
        conn.execute("SELECT update_distributed_table_colocation('child_deliveries', colocate_with => 'none')")
        try:
            assert citus_scan.covered(conn, keys).why == "child_deliveries not co-located with workflow_runs"
            stats = engine.coordinator(batch=10).run_once(["timers", "leases"])
            assert (stats.node_scans, stats.scans_through_coordinator, stats.errors) == (0, True, [])
        finally:        # the session's database, shared by the tests after this one
            conn.execute("SELECT update_distributed_table_colocation('child_deliveries', "
                         "colocate_with => 'workflow_runs')")
        assert citus_scan.covered(conn, keys).why is None
