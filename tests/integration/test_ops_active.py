"""composer_ops.ops active tasks and leases on the seeded database: exact figures,
under the suite's New York session and under Asia/Tokyo."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import polars as pl
import psycopg
import pytest

from composer_ops import ops
from composer_ops.errors import ComposerError, Invalid
from composer_ops.ops import anomalies, charts, display
from composer_ops.testing import fixtures
from tests.integration.helpers import connect_in_tz


@pytest.fixture(params=["America/New_York", "Asia/Tokyo"])
def session(request: pytest.FixtureRequest, db_url: str) -> Iterator[tuple[psycopg.Connection[Any],
                                                                          fixtures.SeedInfo]]:
    with connect_in_tz(db_url, request.param) as conn:
        yield conn, fixtures.seed(conn)
        conn.rollback()


def test_active_tasks_by_state_queue_and_node_type(session: tuple[psycopg.Connection[Any], Any]) -> None:
    conn, info = session
    groups = ops.active_by_group(conn)
    assert groups.select("state", "queue", "node_type", "tasks").rows() == [
        ("PENDING", "payments", "MAP", 2),                  # M1's items 4 and 5
        ("PENDING", "payments", "TASK", 2),
        ("PENDING", "reports", "TASK", 2),
        ("RUNNING", "default", "TASK", 1),
        ("RUNNING", "payments", "MAP", 1),                  # M1's item 3
        ("RUNNING", "payments", "TASK", 3),
        ("RUNNING", "reports", "TASK", 1),
        ("WAITING", "(coordinator)", "SUB_WORKFLOW", 1),    # P1 waits for its child C1
        ("WAITING", "(coordinator)", "WAIT", 1),
        ("WAITING", "(coordinator)", "WAIT_FOR_SIGNAL", 2),
        ("WAITING", "payments", "MAP", 1),                  # M1's MAP node, while its items run
    ]
    oldest = {(s, q, t): (r, n, a) for s, q, t, r, n, a in groups.select(
        "state", "queue", "node_type", "oldest_run_id", "oldest_node_id", "oldest_age_s").iter_rows()}
    assert oldest[("RUNNING", "payments", "TASK")] == (info.runs["L2"], "charge", 1800.0)
    assert oldest[("PENDING", "reports", "TASK")][:2] == (info.runs["L6"], "extract_a")
    assert oldest[("WAITING", "(coordinator)", "WAIT_FOR_SIGNAL")][:2] == (info.runs["H6"], "delivered")
    assert oldest[("RUNNING", "reports", "TASK")][2] == 2 * 86400.0


def test_age_histogram_has_every_bucket_and_state(session: tuple[psycopg.Connection[Any], Any]) -> None:
    conn, info = session
    hist = ops.age_histogram(conn)
    assert hist.height == 7 * 4
    per_bucket = dict(hist.group_by("bucket", maintain_order=True).agg(pl.col("tasks").sum()).iter_rows())
    assert per_bucket == fixtures.expected_figures(info)["active_tasks"]["histogram"]
    nonzero = hist.filter(pl.col("tasks") > 0).select("bucket", "state", "tasks").rows()
    assert nonzero == [("1-5 min", "RUNNING", 1), ("5-15 min", "PENDING", 2), ("5-15 min", "RUNNING", 2),
                       ("5-15 min", "WAITING", 1), ("15-60 min", "PENDING", 4), ("15-60 min", "RUNNING", 2),
                       ("15-60 min", "WAITING", 1), ("1-6 h", "WAITING", 1),
                       ("6-24 h", "WAITING", 1), ("> 1 day", "RUNNING", 1), ("> 1 day", "WAITING", 1)]


def test_oldest_tasks_top_runs_and_run_count(session: tuple[psycopg.Connection[Any], Any]) -> None:
    conn, info = session
    oldest = ops.active_tasks(conn, limit=3)
    assert oldest.select("run_id", "node_id").rows() == [
        (info.runs["H6"], "delivered"), (info.runs["L7"], "extract_a"), (info.runs["L5"], "delivered")]
    assert ops.active_tasks(conn).height == 17
    top = ops.top_runs(conn, limit=3)
    assert top.select("run_id", "active_tasks", "workflow_id", "status").rows() == [
        (info.runs["M1"], 4, "charge-all", "RUNNING"), (info.runs["L6"], 2, "nightly-report", "RUNNING"),
        (info.runs["H6"], 1, "order-fulfilment", "RUNNING")]
    assert ops.active_run_count(conn) == 13
    with pytest.raises(Invalid):
        ops.top_runs(conn, limit=0)


def test_outbox_backlog_ready_and_delayed(session: tuple[psycopg.Connection[Any], Any]) -> None:
    conn, _ = session
    backlog = ops.outbox_backlog(conn)
    assert backlog.select("queue", "rows", "ready", "delayed", "max_attempt").rows() == [
        ("payments", 3, 3, 0, 0), ("reports", 2, 1, 1, 1)]
    assert backlog["oldest_ready_age_s"].to_list() == [700.0, 1800.0]
    assert backlog["last_delayed_until"][0] is None


def test_map_items_per_queue(session: tuple[psycopg.Connection[Any], Any]) -> None:
    """M1's MAP node (6 items, max_parallel 2, 5 dispatched, 3 finished): item 3 running,
    item 4 in the outbox, item 5 held back; the finished M9 has none active."""
    conn, info = session
    assert ops.map_items(conn).rows() == [("payments", 1, 1, 1, 1)]
    assert ops.map_items(conn).columns == ["queue", "running", "dispatched", "held", "runs"]
    assert fixtures.expected_figures(info)["active_tasks"]["map_items"] == {
        "payments": {"running": 1, "dispatched": 1, "held": 1}}


def test_running_leases_expiry_buckets_and_owners(session: tuple[psycopg.Connection[Any], Any]) -> None:
    conn, info = session
    leases = ops.running_leases(conn)
    assert leases.select("run_id", "expires_in_s", "expired", "bucket").rows() == [
        (info.runs["L9"], None, False, "no lease"),          # odd data: RUNNING without a lease
        (info.runs["L7"], -7200.0, True, "expired > 1 h ago"),
        (info.runs["L2"], -900.0, True, "expired 5-60 min ago"),
        (info.runs["L1"], 1200.0, False, "expires in 5-30 min"),
        (info.runs["M1"], 1500.0, False, "expires in 5-30 min"),     # a MAP item holds a lease like any task
        (info.runs["L3"], 7200.0, False, "expires in > 30 min")]
    buckets = dict(ops.expiry_buckets(leases).select("bucket", "tasks").iter_rows())
    assert buckets == fixtures.expected_figures(info)["lease_expiries"]["buckets"]
    expired = ops.expired_running(leases=leases)
    assert expired.select("run_id", "overdue_s").rows() == [(info.runs["L7"], 7200.0), (info.runs["L2"], 900.0)]
    owners = ops.lease_owners(conn)
    assert owners.select("lease_owner", "running", "expired", "max_overdue_s", "suspect_dead").rows() == [
        ("(none)", 1, 0, None, False), ("worker-a", 3, 0, 0.0, False), ("worker-b", 2, 2, 7200.0, True)]
    assert ops.without_lease(leases).select("run_id", "node_id").rows() == [(info.runs["L9"], "charge")]


def test_attempts_and_recent_requeues(session: tuple[psycopg.Connection[Any], Any]) -> None:
    conn, info = session
    assert ops.attempt_distribution(conn).rows() == [
        (0, "PENDING", 5), (0, "RUNNING", 4), (0, "WAITING", 5), (1, "PENDING", 1), (1, "RUNNING", 1),
        (2, "RUNNING", 1)]
    requeues = ops.recent_requeues(conn)
    assert requeues.select("run_id", "node_id", "attempt", "since_s", "last_error").rows() == [
        (info.runs["L6"], "extract_a", 1, 120.0, "connection reset by peer"),
        (info.runs["L2"], "charge", 2, 1000.0, "card processor timeout")]
    assert ops.recent_requeues(conn, window_s=600).height == 1
    assert ops.recent_requeues(conn, window_s=8000)["node_id"].to_list() == ["extract_a", "charge", "extract_a"]
    with pytest.raises(Invalid):
        ops.recent_requeues(conn, window_s=0)


def test_long_waits_are_wait_for_event_nodes_without_a_timeout(session: tuple[psycopg.Connection[Any], Any]) -> None:
    conn, info = session
    # H6 waits for 'delivered' since February 2025 with no timeout; L5's wait has one (wake_at), so it is not listed.
    waits, total = ops.long_waits(conn, older_than_s=86400)
    assert total == 1 and waits.select("run_id", "node_id", "signal_name").rows() == [
        (info.runs["H6"], "delivered", "delivered")]
    assert waits["waiting_s"][0] > 365 * 86400
    assert ops.long_waits(conn, older_than_s=10 * 365 * 86400)[1] == 0
    with pytest.raises(Invalid):
        ops.long_waits(conn, older_than_s=-1)


def test_definition_mismatches_flag_active_work_its_definition_does_not_explain(
        session: tuple[psycopg.Connection[Any], Any]) -> None:
    conn, info = session
    runs = info.runs
    # The seed's own odd definitions have no active task: H9's legacy_audit is COMPLETED and
    # H12 (v3 missing) has no task at all.
    found, total = ops.definition_mismatches(conn)
    assert total == 0 and found.is_empty() and found.columns[0] == "run_id"
    fixtures.odd_definitions(conn, info)
    found, total = ops.definition_mismatches(conn)
    assert total == 3
    assert found.select("run_id", "workflow_id", "workflow_version", "status", "node_id", "node_type", "tasks",
                        "states").rows() == [
        (runs["L7"], "nightly-report", 1, "RUNNING", "extract_a", "TASK", 1, "RUNNING"),    # 2 days old
        (runs["L6"], "nightly-report", 1, "RUNNING", "extract_a", "TASK", 1, "PENDING"),    # 1800 s
        (runs["L8"], "order-fulfilment", 9, "RUNNING", None, None, 1, "PENDING"),           # 700 s, its charge
    ]
    assert found["oldest_age_s"].to_list() == [2 * 86400.0, 1800.0, 700.0]
    # Bounded: the oldest rows, with the total of them all.
    first, total = ops.definition_mismatches(conn, limit=2)
    assert total == 3 and first["run_id"].to_list() == [runs["L7"], runs["L6"]]
    flagged = anomalies.definitions(found)
    assert [(a.kind, a.subject) for a in flagged] == [
        ("task for a node not in its definition", f"run {runs['L7']}, node extract_a"),
        ("task for a node not in its definition", f"run {runs['L6']}, node extract_a"),
        ("definition version missing", f"run {runs['L8']}"),
    ]
    assert "order-fulfilment v9" in flagged[2].detail and "1 active task: PENDING; run RUNNING" in flagged[2].detail
    with pytest.raises(Invalid):
        ops.definition_mismatches(conn, limit=0)


def test_a_map_node_not_in_its_definition_is_one_row_with_its_items(
        session: tuple[psycopg.Connection[Any], Any]) -> None:
    conn, info = session
    # M1's MAP node and its three active items, after charge_all is removed from charge-all v1.
    conn.execute("""UPDATE workflow_definitions SET spec_json = jsonb_set(spec_json, '{nodes}', '[]')
                     WHERE id = 'charge-all'""")
    found, total = ops.definition_mismatches(conn)
    assert total == 1 and found.select("run_id", "node_id", "node_type", "tasks", "states").rows() == [
        (info.runs["M1"], "charge_all", "MAP", 4, "PENDING, RUNNING, WAITING")]


def test_active_tasks_of_a_run_whose_row_is_gone_are_flagged(session: tuple[psycopg.Connection[Any], Any]) -> None:
    """No foreign key holds a task to its run (V011): a run row deleted by hand, or lost
    with a month, leaves its active tasks, which no event can decide. Before, the join
    to the run left them out silently."""
    conn, info = session
    run = info.runs["L6"]
    conn.execute("DELETE FROM workflow_runs WHERE id = %s", (run,))
    found, total = ops.definition_mismatches(conn)
    assert total == 1 and found.select("run_id", "workflow_id", "status", "node_id", "tasks", "states").rows() == [
        (run, None, None, None, 2, "PENDING")]
    (flagged,) = anomalies.definitions(found)
    assert (flagged.kind, flagged.subject) == ("active tasks of a run that does not exist", f"run {run}")
    assert flagged.detail.startswith("2 active tasks (PENDING) whose workflow_runs row is gone"), flagged.detail


def test_an_empty_database_gives_empty_well_typed_frames(conn: psycopg.Connection[Any]) -> None:
    assert ops.active_by_group(conn).is_empty() and ops.map_items(conn).is_empty()
    assert ops.age_histogram(conn)["tasks"].sum() == 0
    assert ops.outbox_backlog(conn).columns[:4] == ["queue", "rows", "ready", "delayed"]
    leases = ops.running_leases(conn)
    assert leases.is_empty() and ops.lease_owners(leases=leases).is_empty()
    assert ops.expiry_buckets(leases)["tasks"].sum() == 0
    assert ops.active_run_count(conn) == 0


def test_a_url_source_opens_and_closes_its_own_read_only_session(db_url: str) -> None:
    with psycopg.connect(db_url) as owner:
        fixtures.seed(owner)
        owner.commit()
    assert ops.active_by_group(db_url)["tasks"].sum() == 17
    with ops.snapshot(db_url) as conn:
        row = conn.execute("SHOW transaction_read_only").fetchone()
        assert row is not None
        assert row[0] == "on"
        with pytest.raises(ComposerError, match="read-only transaction") as refused:
            conn.execute("DELETE FROM task_outbox")
        assert isinstance(refused.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)


def test_a_lease_at_infinity_is_read_and_flagged(db_url: str) -> None:
    """A lease expiry set to 'infinity' or '-infinity' by hand (the engine never writes one)
    loads on every connection composer_ops opens, on PostgreSQL 15 as on newer servers,
    and is flagged as odd."""
    with psycopg.connect(db_url) as owner:
        info = fixtures.seed(owner)
        owner.execute("UPDATE task_instances SET lease_expires_at = 'infinity' WHERE run_id = %s",
                      (info.runs["L1"],))
        owner.execute("UPDATE task_instances SET lease_expires_at = '-infinity' WHERE run_id = %s "
                      "AND node_id = 'express'", (info.runs["L3"],))
    with ops.snapshot(db_url) as conn:
        leases = ops.running_leases(conn)
        story = ops.run_story(conn, info.runs["L1"])
        now = ops.db_now(conn)
    rows = {r: (e, x, b) for r, e, x, b in leases.select("run_id", "expires_in_s", "expired", "bucket").iter_rows()}
    assert rows[info.runs["L1"]] == (float("inf"), False, "expires in > 30 min")
    assert rows[info.runs["L3"]] == (float("-inf"), True, "expired > 1 h ago")
    assert leases.filter(pl.col("run_id") == info.runs["L1"])["lease_expires_at"][0] == datetime.max.replace(tzinfo=UTC)
    odd = ops.without_lease(leases)
    assert sorted(odd["run_id"].to_list()) == sorted([info.runs["L9"], info.runs["L1"], info.runs["L3"]])
    found = {a.subject: a for a in anomalies.leases(odd)}
    assert found[f"run {info.runs['L1']}, node charge"].kind == "RUNNING with an infinite lease"
    assert "lease expiry infinity" in found[f"run {info.runs['L1']}, node charge"].detail
    assert "lease expiry -infinity" in found[f"run {info.runs['L3']}, node express"].detail
    assert found[f"run {info.runs['L9']}, node charge"].kind == "RUNNING without a lease"
    owners = ops.lease_owners(leases=leases)
    assert display.duration(owners.filter(pl.col("lease_owner") == "worker-a")["max_overdue_s"][0]) == "infinite"
    assert display.utc_text(datetime.max.replace(tzinfo=UTC)) == "infinity"
    # The run investigation reads the same task, its time left infinite.
    assert story.tasks.select("node_id", "lease_left_s").rows() == [("charge", float("inf"))]
    running = story.tasks.filter(pl.col("state") == "RUNNING").with_columns(pl.lit(story.run_id).alias("run_id"))
    assert [a.kind for a in anomalies.leases(ops.without_lease(running))] == ["RUNNING with an infinite lease"]
    # The lease timeline leaves the infinite leases off its axis (the anomalies list them).
    figure = charts.lease_timeline(leases, now)
    assert sum(len(trace.x) for trace in figure.data) == leases.height - 3
