"""The live simulator's starts, against a stand-in engine: every planned start is made or
reported with its error, transient errors are retried, and a driver that falls behind
its plan still makes the plan's last starts, and a simulation over before any run
finished waits (up to a deadline) for one."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest

from composer_ops.errors import ComposerError, Conflict, Invalid, Transient
from composer_ops.repo import simulator
from composer_ops.simulate import live
from composer_ops.simulate.live import LiveOptions, LiveSimulation, plan_live


class _Pool:
    @contextmanager
    def connection(self) -> Iterator[None]:
        yield None


class _Engine:
    """Engine.start that raises the scripted errors, one per call, then starts the run;
    ``commit_first`` makes the first call commit before it raises (a lost acknowledgement)."""

    def __init__(self, errors: Sequence[ComposerError] = (), *, delay_s: float = 0.0,
                 commit_first: bool = False) -> None:
        self.errors, self.delay_s, self.commit_first = list(errors), delay_s, commit_first
        self.calls: list[str] = []
        self.started: set[str] = set()
        self.pool = _Pool()

    def start(self, workflow_id: str, input: Any = None, run_id: str | None = None) -> str:
        assert run_id is not None
        self.calls.append(run_id)
        time.sleep(self.delay_s)
        if run_id in self.started:
            raise Conflict(f"run {run_id} already exists")
        if self.commit_first and len(self.calls) == 1:
            self.started.add(run_id)
        if self.errors:
            raise self.errors.pop(0)
        self.started.add(run_id)
        return run_id

    def signal(self, run_id: str, name: str, payload: Any) -> None:
        return None


class _Fleet:
    def exited(self) -> list[Any]:
        return []


@pytest.fixture(autouse=True)
def _repository(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's few reads, answered from the stand-in: no run finishes or waits."""
    monkeypatch.setattr(simulator, "finished_runs", lambda conn, ids: [])
    monkeypatch.setattr(simulator, "waiting_signals", lambda conn, ids: [])


def _one_start(engine: _Engine, monkeypatch: pytest.MonkeyPatch) -> LiveSimulation:
    monkeypatch.setattr(simulator, "existing_runs", lambda conn, ids: set(ids) & engine.started)
    sim = LiveSimulation(engine, LiveOptions(seed=3, runs=1, duration_s=1.0, cancel_rate=0.0))  # type: ignore[arg-type]
    sim._start(plan_live(sim.options)[0], 0.0)
    return sim


def test_a_start_failing_transiently_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _Engine([Transient("connection lost"), Transient("connection lost")])
    sim = _one_start(engine, monkeypatch)
    assert sim.result.run_ids == sorted(engine.started) and len(engine.calls) == 3
    assert len(set(engine.calls)) == 1                           # the same run ID each time
    assert sim.result.start_retries == 2 and sim.result.start_failures == []


def test_a_retried_start_whose_first_call_committed_is_started_once(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _Engine([Transient("connection lost")], commit_first=True)
    sim = _one_start(engine, monkeypatch)
    assert sim.result.run_ids == sorted(engine.started) and len(engine.started) == 1
    assert sim.result.start_failures == []


def test_a_start_refused_for_good_is_reported_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _Engine([Invalid("workflow 'x' is disabled; it accepts no new runs")])
    sim = _one_start(engine, monkeypatch)
    assert len(engine.calls) == 1 and sim.result.run_ids == []
    (failure,) = sim.result.start_failures
    assert (failure.index, failure.error) == (0, "Invalid: workflow 'x' is disabled; it accepts no new runs")


def test_a_start_still_failing_after_its_retries_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _Engine([Transient("server restarting")] * live._START_ATTEMPTS)
    sim = _one_start(engine, monkeypatch)
    assert len(engine.calls) == live._START_ATTEMPTS and sim.result.run_ids == []
    assert [f.error for f in sim.result.start_failures] == ["Transient: server restarting"]


def test_a_driver_behind_its_plan_still_makes_every_planned_start() -> None:
    # Each start takes longer than the plan leaves between them: at the end most of the
    # plan is overdue, and still made.
    engine = _Engine(delay_s=0.05)
    options = LiveOptions(seed=5, runs=12, duration_s=0.2, cancel_rate=0.0)
    sim = LiveSimulation(engine, options)  # type: ignore[arg-type]
    for planned in plan_live(options):
        sim._at(planned.at_s, "start", planned)
    fleet: Any = _Fleet()
    sim._loop(fleet, options.duration_s)
    assert len(sim.result.run_ids) == options.runs and sim.result.start_failures == []
    assert sorted(sim.runs) == list(range(options.runs))


class _QuietFleet:
    """A fleet whose processes all stay up and are stopped when asked."""

    def __init__(self) -> None:
        self.logdir = None

    def worker(self, **kwargs: Any) -> None:
        return None

    def coordinator(self, **kwargs: Any) -> None:
        return None

    def exited(self) -> list[Any]:
        return []

    def terminate(self, kind: str, timeout: float) -> list[Any]:
        return []

    def stop(self, timeout: float, keep_logs: bool) -> None:
        return None


def test_a_simulation_over_before_any_run_finished_waits_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers of a loaded machine serve nothing within the traffic's 0.2 s; the first
    # run finishes 1 s into the wait after the traffic (timed from the wait's start, not
    # the test's: a slow set-up must not eat it). The simulation ends only once it has.
    waiting_since: list[float] = []
    await_progress = LiveSimulation._await_progress

    def timed_wait(self: LiveSimulation, fleet: Any, deadline_s: float) -> None:
        waiting_since.append(time.monotonic())
        await_progress(self, fleet, deadline_s)

    monkeypatch.setattr(LiveSimulation, "_await_progress", timed_wait)
    monkeypatch.setattr(simulator, "clock", lambda conn: datetime.now(UTC))
    monkeypatch.setattr(simulator, "finished_runs",
                        lambda conn, ids: list(ids)[:1]
                        if waiting_since and time.monotonic() >= waiting_since[0] + 1.0 else [])
    monkeypatch.setattr(live, "simulation_fleet", lambda url, behaviour: _QuietFleet())
    engine = _Engine()
    engine.url = ""  # type: ignore[attr-defined]
    options = LiveOptions(seed=5, runs=3, duration_s=0.2, cancel_rate=0.0, kill_workers=0)
    result = LiveSimulation(engine, options).run()  # type: ignore[arg-type]
    assert len(result.run_ids) == options.runs
    assert len(waiting_since) == 1 and 1.0 <= result.progress_wait_s < 30   # ended by the run, not a deadline


def test_the_wait_for_a_first_finished_run_ends_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _Engine()
    options = LiveOptions(seed=5, runs=2, duration_s=0.2, cancel_rate=0.0)
    sim = LiveSimulation(engine, options)  # type: ignore[arg-type]
    for planned in plan_live(options):
        sim._start(planned, 0.0)
    began = time.monotonic()
    sim._await_progress(_QuietFleet(), 0.6)  # type: ignore[arg-type]
    assert 0.6 <= time.monotonic() - began < 5.0 and not any(s.finished for s in sim.runs.values())
