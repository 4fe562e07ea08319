"""The history backfill writes what a ``Replay`` holds; these tests check that a
Replay holds what the engine leaves. The same runs are driven twice with the same
events, through the real engine (its shell, repository and SQL, on the database's
clock) and through a Replay in memory: every task row, signal and run row must end
up the same, IDs and instants aside (which columns are set is compared)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from composer_ops import Engine
from composer_ops.core.model import CancelRun, SignalReceived, StartRun, TaskCompleted, TaskFailed, TimerDue
from composer_ops.core.spec import parse_spec
from composer_ops.errors import Conflict
from composer_ops.repo.rows import Claim
from composer_ops.simulate.replay import Replay

SPEC: dict[str, Any] = {
    "id": "replay-vs-shell",
    "nodes": [
        {"id": "a", "type": "TASK", "task": "t.a", "input": {"x": "$.input.x"},
         "retry": {"max_attempts": 3, "initial_backoff_s": 0}},
        {"id": "opt", "type": "TASK", "task": "t.opt", "optional": True},
        {"id": "sw", "type": "SWITCH", "depends_on": ["a", "opt"], "expression": "$.nodes.a.output.kind",
         "cases": {"one": ["b"]}, "default": ["c"]},
        {"id": "b", "type": "TASK", "task": "t.b", "depends_on": ["sw"], "input": {"from_a": "$.nodes.a.output"}},
        {"id": "c", "type": "TASK", "task": "t.c", "depends_on": ["sw"]},
        {"id": "after_c", "type": "TASK", "task": "t.after_c", "depends_on": ["c"]},
        {"id": "pause", "type": "WAIT", "depends_on": ["b", "after_c"], "duration_s": 0},
        {"id": "due", "type": "WAIT", "depends_on": ["pause"], "until": "$.input.due"},
        {"id": "go", "type": "WAIT_FOR_SIGNAL", "depends_on": ["pause"], "signal": "go", "timeout_s": 3600},
        {"id": "last", "type": "TASK", "task": "t.last", "depends_on": ["go", "due"],
         "input": {"proof": "$.nodes.go.output"}},
    ],
}
PAST = "2020-01-01T00:00:00+00:00"

# A step: ("complete", node, output) | ("fail", node, error, retryable) | ("timer", node)
#       | ("signal", name, payload) | ("cancel", reason)
Step = tuple[Any, ...]
SCENARIOS: dict[str, tuple[dict[str, Any], list[Step]]] = {
    "retried, optional failure, switch, skips, early and duplicate signal": ({"x": 1, "due": PAST}, [
        ("signal", "go", {"n": 1}),                       # buffered: nothing waits for it yet
        ("fail", "a", "TimeoutError: slow", True),
        ("fail", "opt", "NonRetryableError: no", False),
        ("complete", "a", {"kind": "one"}),
        ("complete", "b", {"done": True}),
        ("timer", "pause"),                               # go consumes the buffered signal as it is created
        ("signal", "go", {"n": 2}),                       # a duplicate: buffered, never consumed
        ("timer", "due"),
        ("complete", "last", "ok"),
    ]),
    "the other branch, a signal resolving a waiting node": ({"x": 2, "due": PAST}, [
        ("complete", "opt", {"score": 0.5}),
        ("complete", "a", {"kind": "two"}),
        ("complete", "c", 3),
        ("complete", "after_c", 4),
        ("timer", "pause"),
        ("timer", "due"),
        ("signal", "go", {"n": 3}),
        ("complete", "last", None),
    ]),
    "retries exhausted: the run fails, active tasks are cancelled": ({"x": 3, "due": PAST}, [
        ("fail", "a", "ConnectionResetError: reset", True),
        ("fail", "a", "ConnectionResetError: reset", True),
        ("fail", "a", "ConnectionResetError: reset", True),
    ]),
    "an until that is no instant fails the run": ({"x": 4, "due": "soon"}, [
        ("complete", "a", {"kind": "one"}),
        ("complete", "opt", {}),
        ("complete", "b", {}),
        ("timer", "pause"),
    ]),
    "a cancelled run, a signal refused after it": ({"x": 5, "due": PAST}, [
        ("complete", "a", {"kind": "one"}),
        ("cancel", "operator: wrong input"),
        ("signal", "go", {"n": 4}),
    ]),
}


@dataclass
class _Both:
    """One run on both sides, steps applied to each."""

    engine: Engine
    replay: Replay
    run_id: str
    refused: list[str] = field(default_factory=list)

    def step(self, step: Step) -> None:
        kind = step[0]
        if kind in ("complete", "fail"):
            node = step[1]
            claim = self._claim(node)
            ref = self.replay.claim(node, claim.lease_owner)
            if kind == "complete":
                self.engine.complete(claim, step[2])
                self.replay.send(TaskCompleted(ref=ref, output=step[2], now=self.replay.now))
            else:
                self.engine.fail(claim, step[2], retryable=step[3])
                self.replay.send(TaskFailed(ref=ref, error=step[2], retryable=step[3], now=self.replay.now))
        elif kind == "timer":
            node = step[1]
            task_id = self.engine.get_run(self.run_id).tasks[self._index(node)].id
            self.engine.shell.handle(self.run_id, lambda now: TimerDue(task_id=task_id, node_id=node, now=now))
            self.replay.send(TimerDue(task_id=self.replay.rows[node].task_id, node_id=node, now=self.replay.now))
        elif kind == "signal":
            self._both(lambda: self.engine.signal(self.run_id, step[1], step[2]),
                       lambda: self.replay.send(SignalReceived(name=step[1], payload=step[2], now=self.replay.now)))
        else:
            self._both(lambda: self.engine.cancel(self.run_id, step[1]),
                       lambda: self.replay.send(CancelRun(reason=step[1], now=self.replay.now)))
        self.replay.now += timedelta(milliseconds=10)

    def _both(self, engine: Callable[[], object], replay: Callable[[], object]) -> None:
        outcomes = []
        for side in (engine, replay):
            try:
                side()
                outcomes.append("applied")
            except Conflict as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1]
        if outcomes[0] != "applied":
            self.refused.append(outcomes[0])

    def _claim(self, node: str) -> Claim:
        task = SPEC["nodes"][self._spec_index(node)]["task"]
        claims = self.engine.claim(["default"], "worker-1", 1, task_names=[task])
        assert [c.node_id for c in claims] == [node]
        return claims[0]

    def _index(self, node: str) -> int:
        return [t.node_id for t in self.engine.get_run(self.run_id).tasks].index(node)

    @staticmethod
    def _spec_index(node: str) -> int:
        return [n["id"] for n in SPEC["nodes"]].index(node)


def _set(value: object) -> bool:
    return value is not None


def _database_side(url: str, run_id: str) -> dict[str, Any]:
    with psycopg.connect(url, row_factory=dict_row) as conn:
        run = conn.execute("SELECT status, output_json, error_json FROM workflow_runs WHERE id = %s",
                           (run_id,)).fetchone()
        tasks = conn.execute("SELECT * FROM task_instances WHERE run_id = %s", (run_id,)).fetchall()
        events = conn.execute("SELECT name, payload, consumed_at FROM workflow_events WHERE run_id = %s "
                              "ORDER BY created_at, id", (run_id,)).fetchall()
    assert run is not None
    return {
        "run": (run["status"], run["output_json"], run["error_json"]),
        "tasks": {t["node_id"]: (t["node_type"], t["queue"], t["state"], t["attempt"], t["input_json"],
                                 t["output_json"], t["last_error"], t["branches"], t["signal_name"],
                                 t["wake_at"] if t["node_id"] == "due" else _set(t["wake_at"]),
                                 _set(t["started_at"]), _set(t["finished_at"]), _set(t["completed_at"]),
                                 t["lease_owner"], _set(t["lease_expires_at"]))
                  for t in tasks},
        "signals": [(e["name"], e["payload"], _set(e["consumed_at"])) for e in events],
    }


def _replay_side(replay: Replay) -> dict[str, Any]:
    return {
        "run": (str(replay.status), replay.run_output,
                {"error": replay.run_reason} if replay.run_reason else None),
        "tasks": {r.node_id: (str(r.node_type), r.queue, str(r.state), r.attempt, r.input, r.output,
                              {"error": r.error} if r.error else None,
                              list(r.branches) if r.branches is not None else None, r.signal_name,
                              r.wake_at if r.node_id == "due" else _set(r.wake_at),
                              _set(r.started_at), _set(r.finished_at), _set(r.completed_at),
                              r.lease_owner, _set(r.lease_expires_at))
                  for r in replay.rows.values()},
        "signals": [(s.name, s.payload, _set(s.consumed_at)) for s in replay.signals],
    }


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_replay_leaves_the_rows_the_engine_leaves(db_url: str, scenario: str) -> None:
    run_input, steps = SCENARIOS[scenario]
    spec = parse_spec(SPEC)
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(SPEC)
        run_id = engine.start(SPEC["id"], input=run_input)
        both = _Both(engine, Replay(spec, run_id=run_id, input=run_input, now=datetime.now(UTC)), run_id)
        both.replay.send(StartRun(now=both.replay.now))
        for step in steps:
            both.step(step)
    database, replay = _database_side(db_url, run_id), _replay_side(both.replay)
    assert replay["tasks"] == database["tasks"]
    assert replay == database
    # Each scenario ends where its name says.
    expected = {"retried": "SUCCEEDED", "the other": "SUCCEEDED", "retries": "FAILED", "an until": "FAILED",
                "a cancelled": "CANCELLED"}
    assert database["run"][0] == next(v for k, v in expected.items() if scenario.startswith(k))
    assert bool(both.refused) == scenario.startswith("a cancelled")
