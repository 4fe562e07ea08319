"""MAP nodes end to end on a real server: items claimed, completed, failed and
cancelled through the engine (repo/items.py and the shell's MAP actions)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, TaskContext, Worker
from composer_ops.repo import partitions, runs
from composer_ops.repo.items import ANALYZE_AT
from composer_ops.repo.rows import Claim
from composer_ops.testing.processes import wait_for
from tests.notebooks.harness import as_role


def map_spec(wf: str = "fan", **extra: Any) -> dict[str, Any]:
    return {"id": wf, "nodes": [
        {"id": "each", "type": "MAP", "items": "$.input.ids", "task": "item.work", "queue": "items",
         "input": {"region": "$.input.region"}, **extra},
        {"id": "after", "type": "TASK", "task": "item.after", "queue": "items", "depends_on": ["each"],
         "input": {"all": "$.nodes.each.output"}}]}


def claim_all(engine: Engine, owner: str = "w1") -> list[Claim]:
    return engine.claim(["items"], owner, 100)


def item_rows(db_url: str, run_id: str) -> list[tuple[int, str]]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT item_index, state FROM task_instances WHERE run_id = %s "
                            "AND item_index IS NOT NULL ORDER BY item_index", (run_id,)).fetchall()
    return [(int(i), str(s)) for i, s in rows]


def outbox_rows(db_url: str, run_id: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT count(*) FROM task_outbox WHERE run_id = %s", (run_id,)).fetchone()
    assert row is not None
    return int(row[0])


def test_items_run_at_most_max_parallel_at_once_and_output_in_item_order(engine: Engine, db_url: str) -> None:
    engine.deploy(map_spec(max_parallel=3))
    run_id = engine.start("fan", input={"ids": ["a", "b", "c", "d", "e"], "region": "eu"})
    first = claim_all(engine)
    assert sorted(c.input["index"] for c in first) == [0, 1, 2]
    assert {c.node_id for c in first} == {"each"}
    assert {(c.input["index"], c.input["item"], c.input["region"]) for c in first} == {
        (0, "a", "eu"), (1, "b", "eu"), (2, "c", "eu")}
    assert claim_all(engine) == []                   # three in flight: nothing more is dispatched
    by_index = {c.input["index"]: c for c in first}
    engine.complete(by_index[1], "B")
    nxt = claim_all(engine)
    assert [c.input["index"] for c in nxt] == [3]
    for claim in (by_index[2], by_index[0], nxt[0]):
        engine.complete(claim, claim.input["item"].upper())
    last = claim_all(engine)
    assert [c.input["index"] for c in last] == [4]
    engine.complete(last[0], "E")
    after = claim_all(engine)
    assert [c.node_id for c in after] == ["after"]
    assert after[0].input == {"all": ["A", "B", "C", "D", "E"]}
    engine.complete(after[0], "ok")
    run = engine.get_run(run_id)
    assert run.status == "SUCCEEDED"
    each = [t for t in run.tasks if t.node_id == "each" and t.item_index is None]
    assert len(each) == 1 and each[0].output == ["A", "B", "C", "D", "E"]
    assert [i for i, _ in item_rows(db_url, run_id)] == [0, 1, 2, 3, 4]
    with psycopg.connect(db_url) as conn:
        counters = conn.execute("SELECT items_total, items_started, items_done, items_failed FROM task_instances "
                                "WHERE run_id = %s AND node_id = 'each' AND item_index IS NULL",
                                (run_id,)).fetchone()
    assert counters == (5, 5, 5, 0)


def test_an_item_event_loads_the_node_rows_only(engine: Engine, db_url: str) -> None:
    engine.deploy(map_spec(max_parallel=2))
    run_id = engine.start("fan", input={"ids": list(range(50))})
    with psycopg.connect(db_url) as conn, conn.transaction():
        _, loaded = runs.lock_and_load(conn, run_id)
    assert set(loaded) == {"each"}
    counts = loaded["each"].items
    assert counts is not None and (counts.total, counts.started) == (50, 2)


def test_an_item_event_does_not_read_the_runs_input(engine: Engine, db_url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's context (here its input, the list of items) is read only when a decision
    needs it: an item's completion that dispatches the next item does not; the one that
    creates a node whose input refers to the run's input does, under the same lock."""
    spec = map_spec(max_parallel=2)
    spec["nodes"][1]["input"] = {"all": "$.nodes.each.output", "region": "$.input.region"}
    engine.deploy(spec)
    run_id = engine.start("fan", input={"ids": list(range(6)), "region": "eu"})
    with psycopg.connect(db_url) as conn, conn.transaction():
        row, _ = runs.lock_and_load(conn, run_id)
    assert row.context is None                       # not read with the lock
    reads: list[str] = []
    load = runs.load_context

    def counted(conn: Any, rid: str) -> Any:
        reads.append(rid)
        return load(conn, rid)

    monkeypatch.setattr(runs, "load_context", counted)
    done = 0
    while done < 6:
        for claim in claim_all(engine):
            engine.complete(claim, claim.input["item"])
            done += 1
            if done == 5:
                assert reads == []                   # five item events, four of them dispatching
    assert reads == [run_id]                         # the last item's: it creates 'after'
    (after,) = claim_all(engine)
    assert after.input == {"all": list(range(6)), "region": "eu"}


@pytest.mark.parametrize(("ids", "kind"), [({"a": 1}, "an object"), ("abc", "a string"), (None, "null")])
def test_items_not_a_list_fail_the_run_clearly(engine: Engine, ids: Any, kind: str) -> None:
    engine.deploy(map_spec())
    run_id = engine.start("fan", input={"ids": ids})
    run = engine.get_run(run_id)
    assert run.status == "FAILED"
    assert run.error == {"error": f'node "each" failed: items $.input.ids resolved to {kind}, not a list'}


def test_a_failed_item_fails_the_node_and_cancels_the_other_items(engine: Engine, db_url: str) -> None:
    engine.deploy(map_spec(max_parallel=2, retry={"max_attempts": 1}))
    run_id = engine.start("fan", input={"ids": [1, 2, 3, 4]})
    first = sorted(claim_all(engine), key=lambda c: c.input["index"])
    engine.fail(first[0], "card declined")
    run = engine.get_run(run_id)
    assert run.status == "FAILED"
    assert run.error == {"error": 'node "each" failed: item 0 failed: after 1 attempt: card declined'}
    assert item_rows(db_url, run_id) == [(0, "FAILED"), (1, "CANCELLED"), (2, "CANCELLED"), (3, "CANCELLED")]
    assert outbox_rows(db_url, run_id) == 0
    assert engine.complete(first[1], "late").stale is not None


def test_continue_policy_finishes_with_null_for_failed_items(engine: Engine) -> None:
    engine.deploy(map_spec(max_parallel=5, on_item_failure="continue", retry={"max_attempts": 1}))
    engine.start("fan", input={"ids": [1, 2, 3]})
    for claim in claim_all(engine):
        if claim.input["index"] == 1:
            engine.fail(claim, "no", retryable=False)
        else:
            engine.complete(claim, claim.input["item"] * 10)
    (after,) = claim_all(engine)
    assert after.input == {"all": [10, None, 30]}


def test_cancelling_the_run_cancels_every_item(engine: Engine, db_url: str) -> None:
    engine.deploy(map_spec(max_parallel=2))
    run_id = engine.start("fan", input={"ids": [1, 2, 3]})
    claim_all(engine)
    engine.cancel(run_id, reason="stop")
    assert {s for _, s in item_rows(db_url, run_id)} == {"CANCELLED"}
    assert outbox_rows(db_url, run_id) == 0


def test_retrying_a_failed_map_runs_its_items_again(engine: Engine, db_url: str) -> None:
    engine.deploy(map_spec(max_parallel=2, retry={"max_attempts": 1}))
    run_id = engine.start("fan", input={"ids": [1, 2]})
    first = sorted(claim_all(engine), key=lambda c: c.input["index"])
    engine.complete(first[0], "x")
    engine.fail(first[1], "no")
    assert engine.get_run(run_id).status == "FAILED"
    engine.retry(run_id)
    assert item_rows(db_url, run_id) == [(0, "PENDING"), (1, "PENDING")]
    for claim in claim_all(engine):
        engine.complete(claim, claim.input["item"])
    (after,) = claim_all(engine)
    assert after.input == {"all": [1, 2]}


def test_a_worker_runs_a_map_with_its_handler_getting_item_and_index(engine: Engine) -> None:
    engine.deploy(map_spec(max_parallel=4))
    run_id = engine.start("fan", input={"ids": list(range(30)), "region": "eu"})
    worker = Worker(engine, queues=["items"], concurrency=4, poll_interval=0.1)
    seen: list[tuple[int, Any, str]] = []

    @worker.handler("item.work")
    def work(input: dict[str, Any], ctx: TaskContext) -> Any:
        seen.append((input["index"], input["item"], input["region"]))
        return input["item"] * 2

    @worker.handler("item.after")
    def after(input: dict[str, Any], ctx: TaskContext) -> Any:
        return sum(input["all"])

    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        run = wait_for(lambda: (r := engine.get_run(run_id)).status != "RUNNING" and r, timeout=120, what="the run")
    finally:
        worker.stop()
        thread.join(60)
    assert run.status == "SUCCEEDED"
    assert run.output == {"after": sum(i * 2 for i in range(30))}
    assert sorted(seen) == [(i, i, "eu") for i in range(30)]


def test_a_large_map_gives_a_month_without_statistics_its_first_and_lookups_use_the_key(db_url: str) -> None:
    """Without statistics the planner reads every item of the run for one item's lookup
    (sql/R__items.sql); the engine role's MAP insert analyzes such a month once."""
    with Engine.connect(as_role(db_url, "composer_ops_engine"), pool_size=2) as engine:
        engine.deploy(map_spec(max_parallel=2))
        run_id = engine.start("fan", input={"ids": list(range(ANALYZE_AT))})
        (claim, _) = engine.claim(["items"], "w1", 10)
    with psycopg.connect(db_url) as conn:
        tasks = partitions.run_tables(conn, run_id)[1]
        stats = conn.execute("SELECT count(*) FROM pg_stats WHERE tablename = %s AND attname = 'run_id'",
                             (tasks,)).fetchone()
        plan = "\n".join(r[0] for r in conn.execute(
            f"EXPLAIN SELECT id FROM {tasks} WHERE run_id = %s AND id = %s AND node_id = 'each'".encode(),
            (run_id, claim.task_id)).fetchall())
        again = conn.execute("SELECT composer_analyze_new_tasks(%s)", (tasks,)).fetchone()
    assert stats == (1,)
    assert "pkey" in plan, plan
    assert again == (False,)                  # it has statistics now: nothing is analyzed again


#: An item output under the 8 MiB limit on its own; three of them assemble to more.
BIG_ITEM = "x" * (3 * 1024 * 1024)
#: The assembled output's size as the JSON check counts it: three quoted strings, two commas, brackets.
BIG_MAP = 3 * (len(BIG_ITEM) + 2) + 2 + 2


def test_items_under_the_limit_assembling_to_more_fail_the_node_cleanly(engine: Engine, db_url: str) -> None:
    engine.deploy(map_spec(max_parallel=3, retry={"max_attempts": 3}))
    run_id = engine.start("fan", input={"ids": [1, 2, 3]})
    for claim in claim_all(engine):
        assert engine.complete(claim, BIG_ITEM).stale is None
    run = engine.get_run(run_id)
    why = f'the assembled output of node "each" is {BIG_MAP} bytes of JSON; the limit is 8388608'
    assert run.status == "FAILED"
    assert run.error == {"error": f'node "each" failed: {why}'}
    (each,) = [t for t in run.tasks if t.node_id == "each" and t.item_index is None]
    assert (each.state, each.output, each.error) == ("FAILED", None, {"error": why})
    assert item_rows(db_url, run_id) == [(0, "COMPLETED"), (1, "COMPLETED"), (2, "COMPLETED")]
    assert [t for t in run.tasks if t.node_id == "after"] == []
    assert outbox_rows(db_url, run_id) == 0
    assert claim_all(engine) == []
    with psycopg.connect(db_url) as conn:          # nothing over the limit was stored
        row = conn.execute("SELECT max(octet_length(output_json::text)) FROM task_instances WHERE run_id = %s",
                           (run_id,)).fetchone()
    assert row is not None and row[0] < 8 * 1024 * 1024


def test_an_optional_map_over_the_limit_fails_and_the_run_goes_on(engine: Engine) -> None:
    engine.deploy(map_spec(max_parallel=3, optional=True))
    run_id = engine.start("fan", input={"ids": [1, 2, 3]})
    worker = Worker(engine, queues=["items"], concurrency=3, poll_interval=0.1)

    @worker.handler("item.work")
    def work(input: dict[str, Any], ctx: TaskContext) -> Any:
        return BIG_ITEM                  # each one passes the worker's own check of its output

    @worker.handler("item.after")
    def after(input: dict[str, Any], ctx: TaskContext) -> Any:
        return {"all": input["all"]}

    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        run = wait_for(lambda: (r := engine.get_run(run_id)).status != "RUNNING" and r, timeout=120, what="the run")
    finally:
        worker.stop()
        thread.join(60)
    assert run.status == "SUCCEEDED"
    assert run.output == {"after": {"all": None}}
    (each,) = [t for t in run.tasks if t.node_id == "each" and t.item_index is None]
    assert each.state == "FAILED"
    assert each.error == {"error": f'the assembled output of node "each" is {BIG_MAP} bytes of JSON; '
                                   'the limit is 8388608'}
