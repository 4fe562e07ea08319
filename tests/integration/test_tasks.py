"""A decision's new tasks are inserted by one statement: a fan-out of 8 is one INSERT."""

from __future__ import annotations

from typing import Any

import pytest

from composer_ops import Engine
from composer_ops.repo import tasks

FAN = {"id": "fan", "nodes": [
    {"id": "split", "type": "TASK", "task": "noop"},
    *({"id": f"f{i}", "type": "TASK", "task": "noop", "depends_on": ["split"]} for i in range(8)),
    {"id": "wait", "type": "WAIT", "duration_s": 3600, "depends_on": ["split"]},
    {"id": "join", "type": "TASK", "task": "noop", "depends_on": [*(f"f{i}" for i in range(8)), "wait"]},
]}


def test_completing_the_split_inserts_its_nine_successors_in_one_statement(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    insert = tasks.insert_tasks

    def counted(conn: Any, run_id: str, rows: Any, *, now: Any) -> Any:
        calls.append([r.node_id for r in rows])
        return insert(conn, run_id, rows, now=now)

    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(FAN)
        run_id = engine.start("fan")
        monkeypatch.setattr(tasks, "insert_tasks", counted)
        [split] = engine.claim(["default"], "w", 10, task_names=["noop"])
        assert engine.complete(split, {"n": 8}).applied
        assert calls == [[*(f"f{i}" for i in range(8)), "wait"]]
        claimed = engine.claim(["default"], "w", 20, task_names=["noop"])
        run = engine.get_run(run_id)
    assert sorted(c.node_id for c in claimed) == [f"f{i}" for i in range(8)]
    states = {t.node_id: t.state for t in run.tasks}
    assert states == {"split": "COMPLETED", "wait": "WAITING", **{f"f{i}": "RUNNING" for i in range(8)}}
