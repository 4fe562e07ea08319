"""The read-only role composer_ops_reader (sql/V001): it can read everything the
notebooks read, including partitions created later, and every write or partition
function is refused."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from composer_ops import ops
from composer_ops.db.migrate import migrate
from composer_ops.testing import fixtures
from tests.notebooks.harness import READER, as_role


@pytest.fixture
def seeded_url(db_url: str) -> str:
    with psycopg.connect(db_url) as owner:
        fixtures.seed(owner)
        owner.commit()
    return db_url


@pytest.fixture
def reader(seeded_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(as_role(seeded_url), autocommit=True) as conn:
        row = conn.execute("SELECT current_user").fetchone()
        assert row is not None
        assert row[0] == READER
        yield conn


def test_the_role_cannot_log_in_and_has_no_special_powers(reader: psycopg.Connection[Any]) -> None:
    row = reader.execute("""SELECT rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, rolbypassrls
                              FROM pg_roles WHERE rolname = %s""", (READER,)).fetchone()
    assert row == (False, False, False, False, False)


def test_every_ops_function_works_as_the_reader(reader: psycopg.Connection[Any], seeded_url: str) -> None:
    assert ops.partition_inventory(reader, exact=True)["rows"].sum() == 108
    assert ops.lookahead(reader)["months_ahead"].to_list() == [3, 3, 3, 3]
    assert ops.growth(reader).height > 0
    assert ops.active_by_group(reader)["tasks"].sum() == 17
    assert ops.age_histogram(reader)["tasks"].sum() == 17
    assert ops.active_tasks(reader).height == 17
    assert ops.top_runs(reader).height == 10 and ops.active_run_count(reader) == 13
    assert ops.outbox_backlog(reader)["rows"].sum() == 5
    assert ops.running_leases(reader).height == 6
    assert ops.attempt_distribution(reader)["tasks"].sum() == 17
    assert ops.map_items(reader).rows() == [("payments", 1, 1, 1, 1)]
    assert ops.long_waits(reader)[1] == 1
    assert ops.recent_requeues(reader).height == 2
    plan = ops.retention_plan(reader, datetime(2025, 5, 1, tzinfo=UTC), exact_rows=True)
    assert plan.filter(plan["action"] == "drop")["month"].to_list() == ["202501", "202503"]   # 202412 misaligned
    story = ops.run_story(reader, ops.latest_run_id(reader) or "")
    assert story.status == "FAILED" and story.tasks.height == 8 and story.webhook.height == 1
    # A URL with the role in its options goes through ops' own read-only session.
    assert ops.active_by_group(as_role(seeded_url))["tasks"].sum() == 17


def test_partitions_created_later_are_readable(seeded_url: str, reader: psycopg.Connection[Any]) -> None:
    with psycopg.connect(seeded_url) as owner:
        owner.execute("SELECT composer_ensure_partitions_from('2031-01-01', 0)")
        owner.commit()
    for table in ("workflow_runs", "task_instances", "workflow_events"):
        assert reader.execute(f"SELECT count(*) FROM {table}_p203101".encode()).fetchone() == (0,)
    assert "203101" in ops.partition_inventory(reader, exact=True)["month"].to_list()


REFUSED = [
    "INSERT INTO workflow_definitions (id, name, version, spec_json, created_by) VALUES ('x', 'x', 1, '{}', 'r')",
    "INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s) VALUES ('q', 'r', 't', 0, 'n', 1)",
    "UPDATE workflow_runs SET status = 'CANCELLED'",
    "UPDATE task_instances SET lease_expires_at = now()",
    "DELETE FROM workflow_events",
    "DELETE FROM task_instances_p202501",
    "TRUNCATE webhook_deliveries",
    "SELECT composer_drop_partitions(now())",
    "SELECT composer_ensure_partitions(3)",
    "SELECT composer_ensure_partitions_from('2031-01-01', 0)",
    "SELECT composer_repair_partition_bounds()",
    "CREATE TABLE reader_was_here (x int)",
    "DROP TABLE workflow_events_p202501",
]


def test_writes_and_partition_functions_are_refused(reader: psycopg.Connection[Any]) -> None:
    allowed = []
    for statement in REFUSED:   # autocommit: each refusal is its own transaction
        try:
            reader.execute(statement.encode())
        except psycopg.errors.InsufficientPrivilege:
            continue
        allowed.append(statement)
    assert allowed == []
    assert reader.execute("SELECT count(*) FROM workflow_runs").fetchone() == (25,)


def test_migrating_another_database_of_the_cluster_reuses_the_role(empty_db_url: str) -> None:
    # The role already exists (the template database created it): V001 must not fail.
    migrate(empty_db_url)
    with psycopg.connect(as_role(empty_db_url)) as conn:
        assert conn.execute("SELECT count(*) FROM workflow_runs").fetchone() == (0,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT composer_drop_partitions(now())")
