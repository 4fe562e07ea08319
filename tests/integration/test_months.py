"""The history backfill: reproducible, idempotent, consistent with the definitions'
graphs, and readable by the repository, the engine and the ops analytics as they are."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, ops
from composer_ops.core.model import TERMINAL_TASK_STATES, NodeType
from composer_ops.core.runids import RUN_ID_MAX_AGE, add_months, month_of, month_start, uuid7_timestamp
from composer_ops.core.spec import WorkflowSpec, parse_spec
from composer_ops.errors import ComposerError
from composer_ops.repo import runs as run_repo
from composer_ops.repo import simulator
from composer_ops.simulate import months as generated
from composer_ops.simulate.definitions import definitions, deploy_definitions
from composer_ops.simulate.model import Behaviour
from composer_ops.simulate.months import MonthsOptions, backfill, generated_months, marker_run_id, month_sizes
from composer_ops.testing.servers import Server

SPECS: dict[str, WorkflowSpec] = {doc["id"]: parse_spec(doc) for doc in definitions()}
# Higher rates than the defaults, so a few hundred runs a month show every behaviour.
OPTIONS = MonthsOptions(seed=11, months=3, runs_per_month=300, stuck_months=1, cancel_rate=0.05,
                         behaviour=Behaviour(transient_rate=0.1, permanent_rate=0.02, crash_rate=0.02))


def _backfill(url: str, options: MonthsOptions = OPTIONS, now: datetime | None = None) -> Any:
    with Engine.connect(url, pool_size=2) as engine:
        versions = {wf: v for wf, (v, _) in deploy_definitions(engine).items()}
        with engine.pool.connection() as conn:
            db_now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    return backfill(url, SPECS, versions, options, now=now or db_now)


def _dump(url: str) -> dict[str, list[str]]:
    with psycopg.connect(url) as conn:
        return {table: [r[0] for r in conn.execute(
                    f"SELECT row_to_json(t)::text FROM {table} t ORDER BY run_id, id" if table != "workflow_runs"
                    else f"SELECT row_to_json(t)::text FROM {table} t ORDER BY id").fetchall()]
                for table in ("workflow_runs", "task_instances", "workflow_events")}


@pytest.fixture(scope="module")
def history_db(server: Server, template_db: str) -> Iterator[tuple[str, Any]]:
    """One backfilled database shared by the read-only tests of this module."""
    with server.database(template=template_db) as url:
        yield url, _backfill(url)


def test_same_seed_same_rows_and_a_second_backfill_adds_nothing(db_url: str, server: Server,
                                                                  template_db: str) -> None:
    now = datetime.now(UTC)
    first = _backfill(db_url, now=now)
    with server.database(template=template_db) as other:
        # The other database checks every row's foreign key by its trigger: same rows.
        per_row = _backfill(other, replace(OPTIONS, set_based_checks=False), now=now)
        assert (first.set_based_checks, per_row.set_based_checks) == (True, False)
        assert _dump(other) == _dump(db_url)
    before = _dump(db_url)
    again = _backfill(db_url, now=now)
    assert [m.skipped for m in again.months] == [True, True, True]
    assert again.rows == 0 and _dump(db_url) == before
    assert first.rows == sum(len(v) for v in before.values())
    # Another seed adds its own runs beside them, never the same IDs.
    _backfill(db_url, MonthsOptions(seed=12, months=3, runs_per_month=50), now=now)
    after = _dump(db_url)
    assert len(after["workflow_runs"]) == len(before["workflow_runs"]) + 150
    assert set(before["workflow_runs"]) <= set(after["workflow_runs"])


def test_months_sizes_ids_and_the_marker(history_db: tuple[str, Any]) -> None:
    url, result = history_db
    months = [m.month for m in result.months]
    with psycopg.connect(url) as conn:
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        assert months == generated_months(now, 3)
        assert month_sizes(months, 300, OPTIONS.growth) == {m.month: m.runs for m in result.months}
        assert sum(m.runs for m in result.months) == 900   # the mean is runs_per_month
        for month in months:
            ids = [r[0] for r in conn.execute(f"SELECT id FROM workflow_runs_p{month}").fetchall()]
            assert {month_of(i) for i in ids} == {month}
            assert marker_run_id(OPTIONS.seed, month) in ids
        # Task and event IDs are UUIDv7 stamped when the row was created.
        for table, column in (("task_instances", "created_at"), ("workflow_events", "created_at")):
            rows = conn.execute(f"SELECT id, {column} FROM {table}").fetchall()
            assert rows and all(abs((uuid7_timestamp(i) - at).total_seconds()) < 0.002 for i, at in rows)


def test_rows_follow_the_definitions_graphs(history_db: tuple[str, Any]) -> None:
    url, result = history_db
    with psycopg.connect(url) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        runs = cur.execute("SELECT * FROM workflow_runs").fetchall()
        tasks: dict[str, dict[str, dict[str, Any]]] = {}
        for t in cur.execute("SELECT * FROM task_instances").fetchall():
            tasks.setdefault(t["run_id"], {})[t["node_id"]] = t
    seen: Counter[str] = Counter()
    for run in runs:
        _check_run(run, tasks.get(run["id"], {}), SPECS[run["workflow_definition_id"]], seen)
    # The promised mix.
    assert {"SUCCEEDED", "FAILED", "CANCELLED", "RUNNING"} <= set(seen)
    # The simulator's four workflows use neither MAP nor SUB_WORKFLOW nodes.
    simulated = set(NodeType) - {NodeType.MAP, NodeType.SUB_WORKFLOW}
    assert {f"type {t}" for t in simulated} <= set(seen)
    for what in ("retried", "lease expired", "timed out", "skipped", "signal consumed at creation"):
        assert seen[what] > 0, what
    # Active runs stay only in the most recent month (stuck_months=1); older ones were cleaned up.
    active = {m.month: m.active_runs for m in result.months}
    assert active[result.months[-1].month] >= 1
    assert all(n == 0 for m, n in active.items() if m != result.months[-1].month)


def _check_run(run: dict[str, Any], tasks: dict[str, dict[str, Any]], spec: WorkflowSpec,
               seen: Counter[str]) -> None:
    status = run["status"]
    seen[status] += 1
    assert tasks, f"run {run['id']} has no task"
    for node_id, t in tasks.items():
        ns = spec.nodes[node_id]
        seen[f"type {t['node_type']}"] += 1
        assert t["node_type"] == str(ns.type)
        assert t["queue"] == (ns.queue if ns.type is NodeType.TASK else None)
        assert t["created_at"] >= run["created_at"] and t["scheduled_at"] == t["created_at"]
        assert t["lease_owner"] is None and t["lease_expires_at"] is None
        if ns.type is NodeType.TASK and t["state"] != "SKIPPED":
            # Re-queues: handler failures (within the retry policy) plus lease expiries
            # (within max_lease_expiries, one more when the last one failed the task).
            assert 0 <= t["lease_expiries"] <= ns.max_lease_expiries
            assert 0 <= t["attempt"] - t["lease_expiries"] <= ns.retry.max_attempts - 1
            seen["retried"] += t["attempt"] > 0
            seen["lease expired"] += "lease of " in json.dumps(t["last_error"])
        for dep in ns.depends_on:          # created once every dependency was terminal, not before
            assert tasks[dep]["state"] in TERMINAL_TASK_STATES
            assert tasks[dep]["finished_at"] <= t["created_at"]
        seen["skipped"] += t["state"] == "SKIPPED"
        if t["state"] == "SKIPPED":        # never dispatched
            assert (t["attempt"], t["input_json"], t["started_at"]) == (0, None, None)
            assert t["finished_at"] == t["created_at"]
        if ns.type is NodeType.SWITCH and t["state"] == "COMPLETED":
            assert t["branches"] == t["output_json"]["branches"]
            assert set(t["branches"]) <= set(spec.dependents(node_id))
        if ns.type is NodeType.WAIT_FOR_SIGNAL:
            seen["timed out"] += t["state"] == "FAILED"
            seen["signal consumed at creation"] += t["state"] == "COMPLETED" and t["finished_at"] == t["created_at"]
    active = [n for n, t in tasks.items() if t["state"] not in TERMINAL_TASK_STATES]
    if status == "SUCCEEDED":
        assert set(tasks) == set(spec.nodes) and not active
        assert all(t["state"] != "FAILED" or spec.nodes[n].optional for n, t in tasks.items())
        assert run["completed_at"] == max(t["finished_at"] for t in tasks.values())
        assert set(run["output_json"]) == set(spec.sinks())
    elif status == "FAILED":
        failed = [n for n, t in tasks.items() if t["state"] == "FAILED" and not spec.nodes[n].optional]
        assert len(failed) == 1 and not active
        assert run["error_json"]["error"].startswith(f'node "{failed[0]}" failed')
        cancelled = [t for t in tasks.values() if t["state"] == "CANCELLED"]
        assert all(t["last_error"]["error"].startswith("run failed: ") for t in cancelled)
    elif status == "CANCELLED":
        assert not active and run["error_json"]["error"]
    else:
        assert status == "RUNNING" and run["completed_at"] is None
        assert [tasks[n]["state"] for n in active] == ["WAITING"]
        waiting = tasks[active[0]]
        assert waiting["signal_name"] == "delivered" and waiting["wake_at"] is None


def test_repository_engine_and_analytics_read_the_backfill_as_is(history_db: tuple[str, Any]) -> None:
    url, result = history_db
    with psycopg.connect(url) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM workflow_runs ORDER BY id").fetchall()]
        stuck = [r[0] for r in conn.execute(
            "SELECT id FROM workflow_runs WHERE status = 'RUNNING' ORDER BY id").fetchall()]
        signalled, n_tasks = conn.execute("""
            SELECT e.run_id, (SELECT count(*) FROM task_instances t WHERE t.run_id = e.run_id)
              FROM workflow_events e ORDER BY e.run_id LIMIT 1""").fetchone()  # type: ignore[misc]
    # The analytics the notebooks call, on the rows as written.
    before = datetime.now(UTC)
    plan = {r["month"]: r for r in ops.retention_plan(url, older_than=before).iter_rows(named=True)}
    after = datetime.now(UTC)
    last = result.months[-1].month
    # Retention judges a month only RUN_ID_MAX_AGE after it ended (runs may still arrive
    # in it until then): in the first hour of a month the last backfilled month is too new.
    ended = month_start(add_months(last, 1))
    if after - ended < RUN_ID_MAX_AGE:
        assert (plan[last]["action"], plan[last]["reason"]) == ("keep", "too new")
    elif before - ended >= RUN_ID_MAX_AGE:
        assert (plan[last]["action"], plan[last]["reason"]) == ("keep", "has active runs")
        assert set(plan[last]["active_run_ids"]) == set(stuck)
    assert all(plan[m.month]["action"] == "drop" for m in result.months[:-1])
    story = ops.run_story(url, signalled)
    assert story.tasks.height == n_tasks and story.signals.height >= 1
    with Engine.connect(url, pool_size=2) as engine:
        with engine.pool.connection() as conn, conn.transaction():
            for run_id in ids:                          # the shell's own read path, every run
                row, loaded = run_repo.lock_and_load(conn, run_id)
                snapshot = engine.shell.snapshot(conn, row, loaded)
                view = run_repo.get_run(conn, run_id)
                assert set(snapshot.nodes) == {t.node_id for t in view.tasks}
                assert set(loaded) == set(snapshot.nodes)
        # A stuck order from an old month carries on when its signal finally arrives.
        run_id = stuck[0]
        engine.signal(run_id, "delivered", {"scan": "late, but here"})
        claims = engine.claim(["default"], "test-worker", 5)
        assert [(c.run_id, c.node_id) for c in claims] == [(run_id, "notify")]
        assert claims[0].input["proof"] == {"scan": "late, but here"}
        engine.complete(claims[0], {"sent": True})
        assert engine.get_run(run_id).status == "SUCCEEDED"
        stats = engine.coordinator().run_once()
        assert not stats.errors and stats.timers_fired == stats.leases_expired == 0


def test_a_backfill_cut_short_never_leaves_half_a_month(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    options = MonthsOptions(seed=3, months=2, runs_per_month=200, growth=0.0, chunk_runs=50, processes=2)
    second = generated_months(datetime.now(UTC), 2)[1]
    arrivals = generated._arrivals

    def a_run_fails_in_the_second_month(seed: int, month: str, runs: int) -> list[tuple[float, str]]:
        planned = arrivals(seed, month, runs)
        if month == second:        # its third chunk has a run of a workflow that does not exist
            planned[120] = (planned[120][0], "no-such-workflow")
        return planned

    monkeypatch.setattr(generated, "_arrivals", a_run_fails_in_the_second_month)
    with pytest.raises(KeyError, match="no-such-workflow"):
        _backfill(db_url, options)
    monkeypatch.undo()

    def per_month() -> dict[str, int]:
        with psycopg.connect(db_url) as conn:
            return {m: conn.execute(f"SELECT count(*) FROM workflow_runs_p{m}").fetchone()[0]  # type: ignore[index]
                    for m in generated_months(datetime.now(UTC), 2)}

    first = generated_months(datetime.now(UTC), 2)[0]
    assert per_month() == {first: 200, second: 0}     # chunks of the second month had reached the server
    result = _backfill(db_url, options)
    assert [m.skipped for m in result.months] == [True, False]
    assert per_month() == {first: 200, second: 200}


def test_rows_copied_without_triggers_are_checked_against_their_runs(history_db: tuple[str, Any]) -> None:
    url, result = history_db
    month = result.months[0].month
    with psycopg.connect(url) as conn:
        run_id, task = conn.execute(f"SELECT run_id, id FROM task_instances_p{month} LIMIT 1").fetchone()  # type: ignore[misc]
        simulator.check_references(conn, "task_instances", month, [f"{task}\t{run_id}\tnode\n"])
        missing = marker_run_id(99, month)
        with pytest.raises(ComposerError, match=f"1 rows of month {month} reference no run"):
            simulator.check_references(conn, "task_instances", month,
                                       [f"{task}\t{run_id}\tnode\n", f"{task}\t{missing}\tnode\n"])
