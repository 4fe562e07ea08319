"""A decision's new tasks are written by its one statement (repo/writes.py): a fan-out of 8
and the completion that causes it are one write."""

from __future__ import annotations

from typing import Any

import pytest

from composer_ops import Engine
from composer_ops.repo import writes

FAN = {"id": "fan", "nodes": [
    {"id": "split", "type": "TASK", "task": "noop"},
    *({"id": f"f{i}", "type": "TASK", "task": "noop", "depends_on": ["split"]} for i in range(8)),
    {"id": "wait", "type": "WAIT", "duration_s": 3600, "depends_on": ["split"]},
    {"id": "join", "type": "TASK", "task": "noop", "depends_on": [*(f"f{i}" for i in range(8)), "wait"]},
]}


def test_completing_the_split_inserts_its_nine_successors_in_one_statement(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[str], list[str]]] = []
    send = writes.send

    def counted(conn: Any, doc: Any) -> Any:
        calls.append(([d["n"] for d in doc.get("done", [])], [t["node"] for t in doc.get("tasks", [])]))
        return send(conn, doc)

    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(FAN)
        run_id = engine.start("fan")
        monkeypatch.setattr(writes, "send", counted)
        [split] = engine.claim(["default"], "w", 10, task_names=["noop"])
        assert engine.complete(split, {"n": 8}).applied
        assert calls == [(["split"], [*(f"f{i}" for i in range(8)), "wait"])]
        claimed = engine.claim(["default"], "w", 20, task_names=["noop"])
        run = engine.get_run(run_id)
    assert sorted(c.node_id for c in claimed) == [f"f{i}" for i in range(8)]
    states = {t.node_id: t.state for t in run.tasks}
    assert states == {"split": "COMPLETED", "wait": "WAITING", **{f"f{i}": "RUNNING" for i in range(8)}}
