"""composer_ops.ops run investigation: one run's story on the seeded database."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import polars as pl
import psycopg
import pytest

from composer_ops import ops
from composer_ops.errors import Invalid, NotFound
from composer_ops.testing import fixtures

NOWHERE = "postgresql://nobody@/nowhere?host=/nonexistent"


@pytest.fixture
def seeded(conn: psycopg.Connection[Any]) -> fixtures.SeedInfo:
    return fixtures.seed(conn)


def test_the_story_of_the_failed_run(conn: psycopg.Connection[Any], seeded: fixtures.SeedInfo) -> None:
    story = ops.run_story(conn, seeded.story_run)
    assert (story.run_id, story.status) == (seeded.story_run, "FAILED")
    run = story.run.row(0, named=True)
    assert run["error"] == "node notify failed: smtp 550 mailbox unavailable"
    assert run["duration_s"] == 120.0 and run["partition"] == "workflow_runs_p202503"
    assert run["created_at"] == datetime(2025, 3, 16, 12, tzinfo=UTC)
    tasks = story.tasks
    assert tasks.select("node_id", "state", "attempt").rows() == [
        ("charge", "COMPLETED", 1), ("express", "COMPLETED", 0), ("route", "COMPLETED", 0),
        ("standard", "SKIPPED", 0), ("cool_off", "COMPLETED", 0), ("delivered", "COMPLETED", 0),
        ("notify", "FAILED", 2), ("legacy_audit", "COMPLETED", 0)]   # legacy_audit: odd data, not in v1
    charge = tasks.row(0, named=True)
    assert (charge["queued_s"], charge["ran_s"], charge["last_error"]) == (33.0, 2.0, "card processor timeout")
    assert tasks.filter(pl.col("node_id") == "route")["branches"].to_list() == [["express"]]
    assert story.signals.select("name", "status", "buffered_s").rows() == [
        ("delivered", "consumed", 3.0), ("delivered", "buffered", story.signals["buffered_s"][1])]
    assert story.signals["payload"][0] == '{"proof": "signed-by-recipient"}'
    assert story.outbox.is_empty()
    assert story.webhook.select("attempts", "last_status").rows() == [(1, 200)]


def test_definition_graph_nodes_edges_and_switch_labels(conn: psycopg.Connection[Any],
                                                        seeded: fixtures.SeedInfo) -> None:
    story = ops.run_story(conn, seeded.story_run)
    assert story.nodes.select("node_id", "type", "depth", "state").rows() == [
        ("charge", "TASK", 0, "COMPLETED"), ("route", "SWITCH", 1, "COMPLETED"),
        ("express", "TASK", 2, "COMPLETED"), ("standard", "TASK", 2, "SKIPPED"),
        ("cool_off", "WAIT", 3, "COMPLETED"), ("delivered", "WAIT_FOR_SIGNAL", 4, "COMPLETED"),
        ("notify", "TASK", 5, "FAILED"), ("legacy_audit", "TASK", 0, "COMPLETED")]
    assert story.nodes.filter(~pl.col("in_definition"))["node_id"].to_list() == story.unknown_nodes == ["legacy_audit"]
    assert story.spec_found
    assert story.edges.rows() == [
        ("charge", "route", ""), ("route", "express", "case gold"), ("route", "standard", "default"),
        ("express", "cool_off", ""), ("standard", "cool_off", ""), ("cool_off", "delivered", ""),
        ("delivered", "notify", "")]
    partial = ops.run_story(conn, seeded.runs["L2"])
    assert partial.nodes.filter(pl.col("state") == "NOT REACHED").height == 6
    assert partial.tasks.select("lease_owner", "lease_left_s").rows() == [("worker-b", -900.0)]


def test_a_run_whose_definition_version_is_missing_still_has_a_story(conn: psycopg.Connection[Any],
                                                                      seeded: fixtures.SeedInfo) -> None:
    story = ops.run_story(conn, seeded.runs["H12"])     # order-fulfilment v3 does not exist
    assert not story.spec_found and story.status == "PENDING"
    assert story.run["workflow_version"].to_list() == [3]
    assert story.nodes.is_empty() and story.edges.is_empty() and story.unknown_nodes == []
    found = ops.anomalies.run(story.spec_found, "order-fulfilment", 3, story.unknown_nodes, story.run_id)
    assert [a.kind for a in found] == ["definition version missing"]


def test_gantt_rows_have_a_bar_per_phase(conn: psycopg.Connection[Any], seeded: fixtures.SeedInfo) -> None:
    story = ops.run_story(conn, seeded.story_run)
    bars = ops.gantt_rows(story.tasks, now=seeded.now)
    phases = {(n, p) for n, p in bars.select("node_id", "phase").iter_rows()}
    assert phases == {("charge", "queued"), ("charge", "ran"), ("express", "queued"), ("express", "ran"),
                      ("notify", "queued"), ("notify", "failed"), ("route", "decided"), ("standard", "decided"),
                      ("cool_off", "waiting"), ("delivered", "waiting"), ("legacy_audit", "queued"),
                      ("legacy_audit", "ran")}
    assert bars.filter(pl.col("end") < pl.col("start")).is_empty()
    live = ops.run_story(conn, seeded.runs["L4"])
    waiting = ops.gantt_rows(live.tasks, now=seeded.now).filter(pl.col("node_id") == "cool_off")
    assert waiting.select("phase", "end").rows() == [("waiting", seeded.now)]


def test_latest_run_defaults(conn: psycopg.Connection[Any], seeded: fixtures.SeedInfo) -> None:
    assert ops.latest_run_id(conn) == seeded.story_run
    assert ops.latest_run_id(conn, status="CANCELLED") == seeded.runs["H8"]
    assert ops.latest_run_id(conn, status=None) == seeded.runs["L9"]
    with pytest.raises(Invalid):
        ops.latest_run_id(conn, status="DONE")


@pytest.mark.parametrize("bad", ["not-a-uuid", "", "0195", 42, None,
                                 "3e607b0f-94ca-449c-aa7b-fedb68d6b415",  # a version-4 UUID, not v7
                                 "01959ed3-4200-7ce4-aa5f-17d5a289aee5'; DROP TABLE workflow_runs; --"])
def test_a_bad_run_id_is_refused_before_any_query(bad: Any) -> None:
    # NOWHERE cannot be connected to: reaching the database would raise Unavailable.
    with pytest.raises(Invalid, match="run_id"):
        ops.run_story(NOWHERE, bad)


def test_run_id_is_normalised_and_a_missing_run_is_not_found(conn: psycopg.Connection[Any],
                                                             seeded: fixtures.SeedInfo) -> None:
    assert ops.validate_run_id(seeded.story_run.upper()) == seeded.story_run
    assert ops.run_story(conn, "{" + seeded.story_run.upper() + "}").run_id == seeded.story_run
    missing = fixtures.uuid7_text(datetime(2025, 3, 5, tzinfo=UTC), 999)
    with pytest.raises(NotFound, match=missing):
        ops.run_story(conn, missing)


def test_a_map_node_is_collapsed_and_children_are_linked_both_ways(engine: Any, db_url: str) -> None:
    """MAP items are not tasks of the story (the graph has one node): they are counted by
    state, with the slowest first; a SUB_WORKFLOW's child and parent link to each other;
    active_tasks counts the items."""
    engine.deploy({"id": "kid", "nodes": [{"id": "k", "type": "TASK", "task": "kid.t", "queue": "story"}]})
    engine.deploy({"id": "fan", "nodes": [
        {"id": "each", "type": "MAP", "items": "$.input.ids", "task": "fan.t", "queue": "story", "max_parallel": 3,
         "on_item_failure": "continue", "retry": {"max_attempts": 1}},
        {"id": "call", "type": "SUB_WORKFLOW", "workflow": "kid"}]})
    run_id = engine.start("fan", input={"ids": [1, 2, 3, 4, 5]})
    claims = {(c.node_id, c.input.get("index")): c for c in engine.claim(["story"], "w1", 10)}
    engine.complete(claims[("each", 0)], "a")
    engine.fail(claims[("each", 1)], "no", retryable=False)
    story = ops.run_story(db_url, run_id)
    assert sorted(story.tasks["node_id"].to_list()) == ["call", "each"]
    assert story.nodes.filter(pl.col("node_id") == "each")["state"].to_list() == ["WAITING"]
    assert story.item_states.rows() == [("each", "COMPLETED", 1), ("each", "FAILED", 1), ("each", "PENDING", 2),
                                        ("each", "RUNNING", 1)]
    assert story.slowest_items["item_index"].to_list()[:1] == [2]          # still running: the longest so far
    assert sorted(story.slowest_items["item_index"].to_list()) == [0, 1, 2]             # 3 and 4 never started
    (child,) = engine.get_run(run_id).children
    assert story.links.rows() == [("child", "call", child.id, "kid", "RUNNING")]
    kid = ops.run_story(db_url, child.id)
    assert kid.links.rows() == [("parent", "call", run_id, "fan", "RUNNING")]
    # The engine's counters agree with its item rows: nothing is flagged.
    assert story.map_nodes.rows() == [("each", "WAITING", 5, 5, 1, 1)] and story.map_disagreements == []
    active = ops.active_tasks(db_url)
    assert active.filter((pl.col("run_id") == run_id) & (pl.col("node_id") == "each")).height == 3 + 1  # items + node


def test_a_map_node_whose_counters_disagree_with_its_items_is_flagged(conn: psycopg.Connection[Any],
                                                                     seeded: fixtures.SeedInfo) -> None:
    """The seed's M9 counts 3 done items and has rows for 2: the story still loads, and
    says what differs; M1's counters match its 6 items in 4 states."""
    odd = ops.run_story(conn, seeded.runs["M9"])
    assert odd.map_disagreements == [("charge_all", "counters say 3 items, 3 done, 0 failed; its item rows: "
                                                    "2 items, 2 COMPLETED, 0 FAILED")]
    (flag,) = ops.anomalies.map_items(odd.run_id, odd.map_disagreements)
    assert flag.subject == f"run {seeded.runs['M9']}, node charge_all" and "3 done" in flag.detail
    assert ops.run_story(conn, seeded.runs["M1"]).map_disagreements == []

