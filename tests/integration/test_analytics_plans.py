"""The active-task and lease queries read the partial indexes, not task_instances.

A realistic shape: 20,000 finished tasks (two months of history) and 50 active ones,
then ANALYZE, with the planner's default settings (no enable_seqscan tricks). Every
task_instances partition that holds rows must be read through a partial index
(whatever its name, so a later migration may reshape the lease index); a sequential
scan is accepted only on an empty partition, where it reads no page at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from composer_ops.repo import analytics, clock
from composer_ops.testing.servers import Server

QUERIES = {
    "active_tasks": (analytics.ACTIVE_TASKS_SQL, {"limit": 200}),
    "active_by_group": (analytics.ACTIVE_BY_GROUP_SQL, None),
    "age_histogram": (analytics.AGE_HISTOGRAM_SQL, {"bounds": [60.0, 300.0, 900.0, 3600.0, 21600.0, 86400.0]}),
    "top_runs": (analytics.TOP_RUNS_SQL, {"limit": 10}),
    "active_run_count": (analytics.ACTIVE_RUN_COUNT_SQL, None),
    "running_leases": (analytics.RUNNING_LEASES_SQL, None),
    "attempt_distribution": (analytics.ATTEMPTS_SQL, None),
    "recent_requeues": (analytics.REQUEUES_SQL, {"window_s": 3600.0, "limit": 50}),
    "long_waits": (analytics.LONG_WAITS_SQL, {"older_than_s": 86400.0, "limit": 50}),
    "timers_overdue": (analytics.TIMERS_OVERDUE_SQL, {"older_than_s": 60.0, "limit": 1}),
    "definition_mismatches": (analytics.DEFINITION_MISMATCHES_SQL, {"limit": 50}),
}


@pytest.fixture(scope="module")
def busy_db(server: Server, template_db: str) -> Iterator[str]:
    with server.database(template=template_db) as url, psycopg.connect(url) as conn:
        conn.execute("SELECT composer_ensure_partitions_from(((now() AT TIME ZONE 'UTC') - interval '1 month')::date,"
                     " 0)")
        conn.execute("""INSERT INTO workflow_definitions (id, name, version, spec_json, created_by)
                        VALUES ('wf', 'wf', 1, '{}', 'test')""")
        # 2,000 runs over this month and the previous one, 10 tasks each, all finished...
        conn.execute("""
            INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, created_at)
            SELECT substr(composer_uuid7_bound(ts), 1, 24) || lpad(to_hex(i), 12, '0'), 'wf', 1,
                   CASE WHEN i <= 50 THEN 'RUNNING' ELSE 'SUCCEEDED' END, ts
              FROM (SELECT i, (date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')
                                  - make_interval(days => 20) + make_interval(mins => i * 20) AS ts
                      FROM generate_series(1, 2000) i) s""")
        conn.execute("""
            INSERT INTO task_instances (id, run_id, node_id, node_type, queue, state, attempt, created_at, updated_at,
                                        started_at, finished_at, last_error)
            SELECT r.id || '-' || n, r.id, 'n' || n, 'TASK', 'q' || (n % 3), 'COMPLETED', n % 2, r.created_at,
                   r.created_at, r.created_at, r.created_at, '{"error": "transient"}'
              FROM workflow_runs r, generate_series(1, 10) n""")
        # ...except 50 active ones: RUNNING with leases, PENDING retries, and WAITING timers.
        conn.execute("""
            UPDATE task_instances SET
                   state = CASE WHEN n % 3 = 0 THEN 'RUNNING' WHEN n % 3 = 1 THEN 'PENDING' ELSE 'WAITING' END,
                   lease_owner = CASE WHEN n % 3 = 0 THEN 'w' || (n % 4) END,
                   lease_expires_at = CASE WHEN n % 3 = 0 THEN now() + make_interval(secs => n * 10 - 200) END,
                   wake_at = CASE WHEN n % 3 = 2 THEN now() + make_interval(mins => n) END,
                   updated_at = now() - make_interval(mins => n), finished_at = NULL
              FROM (SELECT run_id AS r, node_id AS nd, row_number() OVER (ORDER BY run_id)::int AS n
                      FROM task_instances WHERE node_id = 'n1' ORDER BY run_id LIMIT 50) a
             WHERE run_id = a.r AND node_id = a.nd""")
        conn.commit()
        conn.execute("ANALYZE workflow_runs")
        conn.execute("ANALYZE task_instances")
        counts = conn.execute("""SELECT count(*), count(*) FILTER (WHERE state IN
                                 ('PENDING', 'RUNNING', 'QUEUED', 'WAITING')) FROM task_instances""").fetchone()
        assert counts == (20000, 50)
        yield url


def _scans(node: dict[str, Any], parent: dict[str, Any] | None = None) -> Iterator[tuple[dict[str, Any], Any]]:
    yield node, parent
    for child in node.get("Plans", []):
        yield from _scans(child, node)


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_query_reads_task_instances_only_through_partial_indexes(busy_db: str, name: str) -> None:
    query, params = QUERIES[name]
    with psycopg.connect(busy_db) as conn:
        partial = {r[0] for r in conn.execute("""
            SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE i.indpred IS NOT NULL""").fetchall()}
        populated = {r[0] for r in conn.execute("""
            SELECT c.relname FROM pg_class c JOIN pg_inherits h ON h.inhrelid = c.oid
             WHERE h.inhparent = 'task_instances'::regclass AND c.relpages > 0""").fetchall()}
        assert len(populated) == 2
        explained = conn.execute(f"EXPLAIN (FORMAT JSON) {query}".encode(),
                                 {**(params or {}), "now": clock.now(conn)}).fetchone()
        assert explained is not None
        plan = explained[0][0]["Plan"]
    seen: dict[str, str] = {}
    for node, _parent in _scans(plan):
        relation = node.get("Relation Name", "")
        if node["Node Type"] == "Bitmap Index Scan" and node["Index Name"].startswith("task_instances_p"):
            assert node["Index Name"] in partial, (name, node["Index Name"])
        if not relation.startswith("task_instances"):
            continue
        if node["Node Type"] == "Seq Scan":
            assert relation not in populated, f"{name}: sequential scan of {relation}"
            continue
        assert node["Node Type"] in {"Index Scan", "Index Only Scan", "Bitmap Heap Scan"}, (name, node["Node Type"])
        if "Index Name" in node:
            assert node["Index Name"] in partial, (name, node["Index Name"])
        seen[relation] = node["Node Type"]
    assert populated <= set(seen), f"{name}: populated partitions not read through an index: {populated - set(seen)}"


def test_the_start_deadline_query_reads_the_outbox_through_its_partial_index(busy_db: str) -> None:
    """check's timers-overdue figure also reads the dispatches past their schedule_to_start
    deadline: through idx_task_outbox_start_by (only rows with a deadline), not by
    scanning an outbox of 5,000 ready rows without one."""
    with psycopg.connect(busy_db) as conn:
        conn.execute("""INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, start_by)
                        SELECT 'q', 'r' || i, 't' || i, 0, 't', 30,
                               CASE WHEN i <= 5 THEN now() - make_interval(mins => i) END
                          FROM generate_series(1, 5000) i""")
        conn.execute("ANALYZE task_outbox")
        explained = conn.execute(f"EXPLAIN (FORMAT JSON) {analytics.STARTS_OVERDUE_SQL}".encode(),
                                 {"older_than_s": 60.0, "limit": 1, "now": clock.now(conn)}).fetchone()
        conn.rollback()
    assert explained is not None
    nodes = [node for node, _parent in _scans(explained[0][0]["Plan"])]
    outbox = [n for n in nodes if n.get("Relation Name") == "task_outbox"]
    assert outbox and all(n["Node Type"] != "Seq Scan" for n in outbox), outbox
    assert {n.get("Index Name") for n in nodes} & {"idx_task_outbox_start_by"}, nodes
