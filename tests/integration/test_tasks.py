"""A decision's new tasks are written by its one statement (repo/writes.py): a fan-out of 8
and the completion that causes it are one write."""

from __future__ import annotations

from typing import Any

import pytest

from composer_ops import Engine
from composer_ops.errors import Conflict
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


def test_a_decision_creating_more_tasks_than_one_statement_takes_is_written_whole(conn: Any) -> None:
    """13 parameters a task: past about 5,040 tasks one statement would pass PostgreSQL's
    65,535 parameters and could never be sent (each retry failing the same way). The
    rows past writes.MAX_ROWS go in statements of their own, in the same transaction,
    the history rows in their order."""
    from composer_ops.repo import clock
    from composer_ops.repo.rows import HistoryEntry, NewTask
    from tests.integration.helpers import add_definition, add_run

    add_definition(conn)
    run_id = add_run(conn)
    n = 5200
    rows = [NewTask(task_id=f"{run_id[:8]}-t{i}", node_id=f"n{i}", node_type="TASK", queue="default",
                    state="SKIPPED") for i in range(n)]
    entries = [HistoryEntry(kind="skipped", node_id=f"n{i}") for i in range(n)]
    doc = writes.document(at=clock.now(conn), run_id=run_id, request="r-many", tasks=rows, history=entries)
    writes.send(conn, doc).result()
    assert conn.execute("SELECT count(*) FROM task_instances WHERE run_id = %s", (run_id,)).fetchone() == (n,)
    nodes = [r[0] for r in conn.execute("SELECT node_id FROM run_history WHERE run_id = %s AND request = 'r-many' "
                                        "ORDER BY seq", (run_id,)).fetchall()]
    assert nodes == [f"n{i}" for i in range(n)]
    again = writes.document(at=clock.now(conn), run_id=run_id, request=None,
                            tasks=[NewTask(task_id="x", node_id="fresh", node_type="TASK", queue="default",
                                           state="SKIPPED"),
                                   NewTask(task_id="y", node_id=f"n{n - 2}", node_type="TASK", queue="default",
                                           state="SKIPPED")])
    with pytest.raises(Conflict, match=rf"\(run_id, node_id\)=\([^)]*, n{n - 2}\) already exists"):
        writes.send(conn, again)
