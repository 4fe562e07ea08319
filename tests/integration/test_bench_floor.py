"""bench.floor: the floor's worker (with the plain claim or the engine's) and starts write
runs the engine reads as its own, and each worker finishes the other's starts (the
hybrids' premise); the summary's ratios;
the CLI's refusals. Procrastinate is not installed for the test suite, so the three
systems are not measured side by side here (`python -m bench.floor` does that)."""

from __future__ import annotations

import dataclasses
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from bench import floor, scenario
from bench.producer import UNFINISHED
from bench.workload import ONE_TASK, make_template, noop
from composer_ops import Engine, Worker
from composer_ops.testing.servers import Server


def _unfinished(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(UNFINISHED["floor"]).fetchone()
    assert row is not None
    return int(row[0])


def _drive(url: str, thread: threading.Thread, stop: Callable[[], None], timeout: float = 120.0) -> None:
    """Run a worker's ``thread`` until no run is unfinished (or ``timeout``, or the thread
    ended), then ``stop`` it; every run must have finished and the thread ended."""
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while _unfinished(url) and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.05)
    finally:
        stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert _unfinished(url) == 0


def _check_runs(url: str, runs: list[str]) -> None:
    """Each run succeeded as the engine shows it: its task completed, a history of a
    start, a claim and a completion, no outbox row left."""
    with Engine.connect(url, pool_size=1) as engine:
        for run_id in runs:
            view = engine.get_run(run_id)
            assert view.status == "SUCCEEDED", run_id
            assert [t.state for t in view.tasks] == ["COMPLETED"], run_id
            assert [h.kind for h in view.history] == ["started", "claimed", "completed"], run_id
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM task_outbox").fetchone() == (0,)


def _floor_starts(url: str, n: int) -> list[str]:
    submit, close = floor.submitter(url)
    try:
        for _ in range(n):
            submit()
    finally:
        close()
    with psycopg.connect(url) as conn:
        return [str(r[0]) for r in conn.execute("SELECT id FROM workflow_runs ORDER BY id").fetchall()]


@pytest.fixture
def url(server: Server) -> Any:
    make_template(server, "bench_tpl_floor_test")
    made = server.create_database("bench_floor_test", template="bench_tpl_floor_test")
    try:
        yield made
    finally:
        server.drop_database("bench_floor_test")
        server.drop_database("bench_tpl_floor_test")


def _claim_function_calls(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT COALESCE(sum(calls), 0) FROM pg_stat_user_functions "
                           "WHERE funcname = 'composer_claim'").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("engine_claim", [False, True], ids=["plain-claim", "engine-claim"])
def test_the_floor_worker_finishes_its_own_and_the_engines_starts(url: str, engine_claim: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:       # the sessions opened from now on count calls
        conn.execute("SELECT current_database()")
        conn.execute(f"ALTER DATABASE {conn.info.dbname} SET track_functions = 'pl'")
    runs = _floor_starts(url, 20)
    with Engine.connect(url, pool_size=1) as engine:
        runs += [engine.start(ONE_TASK["id"]) for _ in range(20)]
    assert len(set(runs)) == 40
    stop = threading.Event()
    counts: dict[str, int] = {}
    _drive(url, threading.Thread(target=lambda: counts.update(floor.work(url, 2, stop, engine_claim=engine_claim)),
                                 daemon=True), stop.set)
    _check_runs(url, runs)
    assert counts["tasks"] == 40 and counts["claims"] == counts["tasks"] + counts["empty"]
    # The claims went where they were asked to (the sessions' counts are flushed as they closed).
    assert (_claim_function_calls(url) >= counts["claims"]) if engine_claim else _claim_function_calls(url) == 0


def test_the_floor_and_each_hybrid_drain_through_their_processes(server: Server) -> None:
    """Through `python -m bench.floor worker` and `bench.producer floor`, as the
    benchmark runs them: each system finishes every run, and the worker that counts its
    claims is the one the system names (the floor's count has no reasons, Composer's has)."""
    template = make_template(server, "bench_tpl_floor_drain_test")
    # system: (whose starts, whether the floor's worker)
    expected = {"floor": ("floor", True), "floor-engine-claim": ("floor", True),
                "composer-start-floor-worker": ("composer", True), "floor-start-composer-worker": ("floor", False)}
    try:
        for system in (floor.FLOOR, *floor.HYBRIDS.values()):
            out = scenario.drain(system, server, template, workers=1, items=30)
            assert out["runs"] == 30, system.tag
            claims = out["claims"]
            assert claims is not None and claims["processes"] == 1 and claims["tasks"] == 30, (system.tag, claims)
            starts, floor_worker = expected[system.tag]
            assert system.name == starts, system.tag
            assert (claims["by_reason"] == {}) == floor_worker, (system.tag, claims)
    finally:
        server.drop_database(template)


def test_at_two_workers_each_system_is_measured_sustained_alone(server: Server) -> None:
    """`--workers 2`: the sustained rate at two worker processes of each system, no
    drain, and the summary of that mode alone. Procrastinate is not installed here, so
    a second floor stands in for it (its rows labelled as Procrastinate's)."""
    peer = types.SimpleNamespace(PROCRASTINATE=dataclasses.replace(floor.FLOOR, label="procrastinate"),
                                 make_template=make_template)
    out = floor.measure(server, rounds=1, runs=20, duration=1.0, max_backlog=20, peer=peer,
                        systems=("floor", "procrastinate"), workers=2)
    assert out["failed"] is None and out["workers"] == 2
    assert sorted(row["system"] for row in out["results"]) == ["floor", "procrastinate"]
    for row in out["results"]:
        assert row["mode"] == "sustained" and row["workers"] == 2, row
        assert row["claims"]["processes"] == 2, row["claims"]
    # Structure only: how many runs a one-second window finishes depends on the machine's load.
    assert list(out["median"]) == ["sustained"] and "floor" in out["ratios"]["sustained"]
    assert floor.table(out).row_count == 2


def test_the_engines_worker_finishes_the_floors_starts(url: str) -> None:
    runs = _floor_starts(url, 20)
    with Engine.connect(url, pool_size=4) as engine:
        worker = Worker(engine, queues=["default"], concurrency=2, poll_interval=0.2)
        worker.handler("noop")(noop)
        _drive(url, threading.Thread(target=worker.run, daemon=True), worker.stop)
    _check_runs(url, runs)


def _row(system: str, mode: str, rnd: int, rate: float, server_ms: float, proc_ms: float) -> dict[str, Any]:
    return {"system": system, "mode": mode, "round": rnd, "runs_per_s": rate,
            "cpu": {"server_ms_per_item": server_ms, "processes_ms_per_item": proc_ms}}


def test_the_summary_takes_each_rounds_ratio_to_procrastinate() -> None:
    rows = [_row("floor", "sustained", 0, 1000, 0.5, 0.5), _row("procrastinate", "sustained", 0, 500, 1.0, 1.0),
            _row("floor", "sustained", 1, 900, 0.6, 0.6), _row("procrastinate", "sustained", 1, 600, 1.2, 1.2),
            _row("floor", "drain", 0, 1500, 0.4, 0.4), _row("procrastinate", "drain", 0, 750, 0.8, 0.8)]
    out = floor.summarize(rows, rounds=2)
    sus = out["ratios"]["sustained"]["floor"]
    assert sus["runs_per_s_rounds"] == [2.0, 1.5] and sus["runs_per_s"] == 1.75
    assert sus["cpu_rounds"] == [0.5, 0.5] and sus["cpu"] == 0.5
    assert out["ratios"]["drain"]["floor"]["runs_per_s_rounds"] == [2.0]       # round 1 had no drain
    assert out["median"]["sustained"]["procrastinate"] == {
        "runs_per_s": 550, "cpu_ms_per_run": 2.2, "server_ms_per_run": 1.1, "processes_ms_per_run": 1.1}
    assert "procrastinate" not in out["ratios"]["sustained"]


@pytest.mark.parametrize("argv, says", [
    (["--systems", "composer,floor"], "--systems takes procrastinate"),
    (["--systems", "procrastinate,nope"], "--systems takes procrastinate"),
    (["--rounds", "0"], "--rounds, --runs, --max-backlog and --workers must be at least 1"),
    (["--workers", "0"], "--rounds, --runs, --max-backlog and --workers must be at least 1"),
    (["--duration", "0"], "--duration more than 0"),
    (["--pgbin", "/nope"], "no PostgreSQL server binaries in /nope"),
])
def test_bad_arguments_are_refused_before_any_server_starts(argv: list[str], says: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        floor.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()[-1]) < 200


def test_the_summary_of_sustained_rounds_alone_has_no_drain() -> None:
    """At W > 1 only the sustained rate is measured: the summary and its table hold that
    mode alone."""
    rows = [_row("floor", "sustained", 0, 1000, 0.5, 0.5), _row("procrastinate", "sustained", 0, 500, 1.0, 1.0)]
    out = floor.summarize(rows, rounds=1)
    assert list(out["median"]) == ["sustained"] and list(out["ratios"]) == ["sustained"]
    assert floor.table({**out, "workers": 4}).row_count == 2


def test_the_summary_leaves_out_a_round_that_measured_no_cpu() -> None:
    """A window that finished no run has no CPU per run: its round counts for the rate
    and not for CPU, and the summary does not fail (the whole run would be lost)."""
    rows = [_row("floor", "sustained", 0, 1000, 0.5, 0.5), _row("procrastinate", "sustained", 0, 500, 1.0, 1.0),
            {**_row("floor", "sustained", 1, 0, 0.0, 0.0), "cpu": {"server_ms_per_item": None,
                                                                 "processes_ms_per_item": None}},
            _row("procrastinate", "sustained", 1, 600, 1.2, 1.2)]
    out = floor.summarize(rows, rounds=2)
    assert out["median"]["sustained"]["floor"] == {"runs_per_s": 500, "cpu_ms_per_run": 1.0,
                                                   "server_ms_per_run": 0.5, "processes_ms_per_run": 0.5}
    assert out["ratios"]["sustained"]["floor"]["runs_per_s_rounds"] == [2.0, 0.0]
    assert out["ratios"]["sustained"]["floor"]["cpu_rounds"] == [0.5]


def test_a_failing_slot_stops_the_floor_worker_and_raises(server: Server) -> None:
    """A slot that cannot work (here: no workflow deployed) stops the others, and the
    worker raises its error instead of serving on with fewer slots."""
    empty = server.create_database("bench_floor_empty_test")
    try:
        stop = threading.Event()
        with pytest.raises(Exception, match="bench-one is not deployed|workflow_definitions"):
            floor.work(empty, 2, stop)
        assert stop.is_set()
    finally:
        server.drop_database("bench_floor_empty_test")
