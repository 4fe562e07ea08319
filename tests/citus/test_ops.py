"""The operator's figures on Citus: sizes and rows from the shards on the worker nodes
(the coordinator's partitions are empty shells), per node; ages judged against one
clock however many shards a query reads; months and partitions named after the
partitions, not their shards."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import polars as pl
import psycopg
import pytest

from composer_ops import Engine, ops
from composer_ops.ops.health import check_health
from composer_ops.repo import partitions
from composer_ops.testing.citus import CitusCluster

SPEC = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]}
RUNS = 120


@pytest.fixture
def started(db_url: str) -> Iterator[list[str]]:
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(SPEC)
        yield [engine.start("one", input={"pad": "x" * 200}) for _ in range(RUNS)]


def test_sizes_and_rows_come_from_the_shards_per_node(db_url: str, started: list[str],
                                                      citus_cluster: CitusCluster) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        for table in partitions.RUN_TABLES:
            conn.execute(f"ANALYZE {table}")
        shard_bytes = {name: int(size) for name, size in conn.execute("""
            SELECT regexp_replace(shard_name, '_[0-9]+$', ''), sum(shard_size) FROM citus_shards
             WHERE shard_name ~ '_p[0-9]{6}_[0-9]+$' GROUP BY 1""").fetchall()}
    month = datetime.now(UTC).strftime("%Y%m")
    inventory = ops.partition_inventory(db_url)
    this_month = inventory.filter(pl.col("month") == month)
    by_table = {r["table"]: r for r in this_month.iter_rows(named=True)}
    assert by_table["workflow_runs"]["rows"] == RUNS and by_table["task_instances"]["rows"] == RUNS
    for table, row in by_table.items():
        assert row["total_bytes"] == shard_bytes[row["partition"]], table     # what citus_shards counts
    # The coordinator's shell of the month holds nothing: the inventory is not reading it.
    with psycopg.connect(db_url) as conn:
        shell = conn.execute("SELECT pg_total_relation_size(%s::regclass)",
                             (f"workflow_runs_p{month}",)).fetchone()
    assert shell is not None and by_table["workflow_runs"]["total_bytes"] > 4 * shell[0]
    nodes = ops.partition_nodes(db_url)
    ports = {int(n.rsplit(":", 1)[1]) for n in nodes["node"].to_list()}
    assert ports == {w.port for w in citus_cluster.workers}          # the data is on both worker nodes
    runs_here = nodes.filter(pl.col("partition") == f"workflow_runs_p{month}")
    assert runs_here.height == 2 and int(runs_here["rows"].sum()) == RUNS
    assert ops.node_totals(nodes)["share"].sum() == pytest.approx(1.0)
    # The retention plan counts the same rows and bytes.
    plan = ops.retention_plan(db_url, datetime.now(UTC) - timedelta(days=400))
    planned = plan.filter(pl.col("month") == month).row(0, named=True)
    assert planned["rows"] == int(this_month["rows"].sum())
    assert planned["bytes"] == int(this_month["total_bytes"].sum())


def test_ages_of_one_report_are_judged_against_one_instant(db_url: str, started: list[str]) -> None:
    # The tasks are spread over every shard; each age is the report's clock minus the
    # task's creation, so creation + age is one instant for all of them.
    with ops.snapshot(db_url) as conn:
        now = ops.db_now(conn)
        oldest = ops.active_tasks(conn, limit=RUNS)
    assert oldest.height == RUNS
    instants = {(c + timedelta(seconds=a)).replace(microsecond=0) for c, a in
                oldest.select("created_at", "age_s").iter_rows()}
    exact = {c + timedelta(seconds=a) for c, a in oldest.select("created_at", "age_s").iter_rows()}
    assert len(instants) == 1 and max(exact) - min(exact) < timedelta(microseconds=2)
    assert abs(min(exact) - now) < timedelta(microseconds=2)


def test_a_run_is_shown_in_its_partition_not_its_shard(db_url: str, started: list[str]) -> None:
    story = ops.run_story(db_url, started[0])
    assert story.run["partition"][0] == partitions.runs_partition(started[0])


def test_active_work_its_definition_does_not_explain_is_found_over_every_shard(
        db_url: str, started: list[str]) -> None:
    # Hand edits: the definition loses its node, and one run names a version that does not exist.
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE workflow_definitions SET spec_json = jsonb_set(spec_json, '{nodes}', '[]') "
                     "WHERE id = 'one'")
        conn.execute("UPDATE workflow_runs SET workflow_version = 9 WHERE id = %s", (started[0],))
    found, total = ops.definition_mismatches(db_url, limit=RUNS)
    assert total == RUNS and found.height == RUNS
    missing = found.filter(pl.col("node_id").is_null())
    assert missing["run_id"].to_list() == [started[0]] and missing["workflow_version"][0] == 9
    assert set(found.filter(pl.col("node_id") == "a")["run_id"].to_list()) == set(started[1:])
    assert found["oldest_age_s"].is_sorted(descending=True)
    first, total = ops.definition_mismatches(db_url, limit=5)
    assert total == RUNS and first.drop("oldest_age_s").rows() == found.head(5).drop("oldest_age_s").rows()


def test_check_reads_every_figure_on_citus_and_sees_overdue_timers(db_url: str) -> None:
    """`check` on a cluster: every figure read (the outbox, wake and lease queries over the
    shards), and a timer left overdue (no coordinator here) alerts as on one server."""
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy({"id": "sleepy", "nodes": [{"id": "nap", "type": "WAIT", "duration_s": 1}]})
        run_id = engine.start("sleepy")
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE task_instances SET wake_at = now() - interval '2 hours' WHERE run_id = %s", (run_id,))
    health = check_health(db_url)
    by_name = {c.name: c for c in health.checks}
    timers = by_name["timers overdue"]
    assert timers.alert and timers.value >= 7000 and run_id in timers.detail, timers
    assert not by_name["sweeper lag"].alert and not by_name["oldest ready outbox row"].alert


def test_a_coordinator_and_a_worker_start_on_a_migrated_cluster_and_refuse_a_pending_file(
        db_url: str, capfd: pytest.CaptureFixture[str]) -> None:
    """The start-up check reads the Citus series (sql/ and sql/citus/) as migrate does."""
    from composer_ops.cli import main

    assert main(["coordinator", "--once", "--database-url", db_url]) == 0
    capfd.readouterr()
    script = "citus/V017__claim_node_fences.sql"
    with psycopg.connect(db_url) as conn:
        row = conn.execute("DELETE FROM schema_migrations WHERE script = %s RETURNING *", (script,)).fetchone()
    try:
        assert row is not None
        assert main(["worker", "--app", "examples.order_worker:make_worker", "--database-url", db_url]) == 1
        err = capfd.readouterr().err
    finally:
        if row is not None:                         # the cluster's database serves the next tests
            with psycopg.connect(db_url) as conn:
                conn.execute(f"INSERT INTO schema_migrations VALUES ({', '.join(['%s'] * len(row))})", row)
    assert "citus/V017__claim_node_fences.sql pending; run `composer-ops migrate`" in err, err
