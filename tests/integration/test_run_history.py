"""A run's history: what happened to it, written with each change, shown by
``composer-ops runs show``; and ``composer-ops signal --key``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from composer_ops import Engine
from composer_ops.testing.processes import Fleet, wait_for

ROOT = Path(__file__).resolve().parents[2]


def cli(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COMPOSER_DATABASE_URL": db_url, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "composer_ops", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_the_history_of_a_run_that_lived_through_a_killed_worker(engine: Engine, db_url: str) -> None:
    """A worker process is SIGKILLed holding the task; its lease lapses, a coordinator
    re-queues it (the default policy: no retry of handler failures), a second worker
    finishes it. The history names the dead worker, the expiry and who finished."""
    engine.deploy({"id": "killed", "nodes": [{"id": "slow", "type": "TASK", "task": "work", "lease_s": 1,
                                              "input": {"sleep": "$.input.sleep"}}]})
    run_id = engine.start("killed", input={"sleep": 30})
    fleet = Fleet(db_url)
    try:
        doomed = fleet.worker(concurrency=1)
        wait_for(lambda: engine.get_run(run_id).tasks[0].state == "RUNNING", timeout=30, what="the claim")
        fleet.kill(doomed)
        with engine.pool.connection() as conn:     # the next attempt is quick
            conn.execute("UPDATE task_instances SET input_json = '{\"sleep\": 0}' WHERE run_id = %s", (run_id,))
        fleet.coordinator()
        fleet.worker(concurrency=1)
        wait_for(lambda: engine.get_run(run_id).status != "RUNNING", timeout=60, what="the run to finish")
    finally:
        fleet.stop()
    run = engine.get_run(run_id)
    assert run.status == "SUCCEEDED"
    dead = f":{doomed.pid}:"
    rows = [(h.kind, h.attempt, h.worker) for h in run.history]
    assert [k for k, _, _ in rows] == ["started", "claimed", "lease_expired", "claimed", "completed"], rows
    owner = str(rows[1][2])
    assert dead in owner and rows[2][2] == owner and rows[1][1] == rows[2][1] == 0
    assert dead not in str(rows[3][2]) and rows[3][1] == rows[4][1] == 1 and rows[3][2] == rows[4][2]
    expiry = run.history[2]
    assert expiry.detail["requeued"] is True and expiry.detail["error"].startswith(f"lease of {owner} expired")
    assert run.history[-1].detail == {"finished": "SUCCEEDED"}
    assert [h.at for h in run.history] == sorted(h.at for h in run.history)

    shown = cli(db_url, "runs", "show", run_id)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    start = lines.index("history:")
    history = lines[start + 1:]
    assert len(history) == 5 and "lease expired" in history[2] and owner in history[2], history
    assert "(re-queued)" in history[2] and "run SUCCEEDED" in history[4]

    as_json = cli(db_url, "runs", "show", run_id, "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert [h["kind"] for h in doc["history"]] == ["started", "claimed", "lease_expired", "claimed", "completed"]
    assert doc["history"][2]["worker"] == owner and "request" not in doc["history"][2]


def test_signals_timers_and_cancels_are_in_the_history(engine: Engine) -> None:
    engine.deploy({"id": "mixed", "nodes": [
        {"id": "nap", "type": "WAIT", "duration_s": 0},
        {"id": "w", "type": "WAIT_FOR_EVENT", "event": "go", "depends_on": ["nap"]},
        {"id": "t", "type": "TASK", "task": "t", "depends_on": ["w"]}]})
    run_id = engine.start("mixed")
    engine.signal(run_id, "go", {"early": True}, key="k1")          # buffered: nobody waits yet
    assert engine.coordinator().run_once().timers_fired == 1        # nap wakes; w consumes the signal
    engine.cancel(run_id, reason="enough")
    history = engine.get_run(run_id).history
    assert [(h.kind, h.node_id) for h in history] == [
        ("started", None), ("signal", None), ("timer", "nap"), ("signal_consumed", "w"), ("cancelled", None)]
    assert history[1].detail["key"] == "k1" and history[1].detail["name"] == "go" and "buffered" in history[1].detail
    assert history[3].detail["signal"] == history[1].detail["buffered"]
    assert history[4].detail == {"reason": "enough", "tasks": 1, "finished": "CANCELLED"}


def test_the_cli_signal_key_resolves_at_most_one_node(engine: Engine, db_url: str) -> None:
    engine.deploy({"id": "twice", "nodes": [{"id": "w1", "type": "WAIT_FOR_EVENT", "event": "go"},
                                            {"id": "w2", "type": "WAIT_FOR_EVENT", "event": "go"}]})
    run_id = engine.start("twice")
    first = cli(db_url, "signal", run_id, "go", "--payload", "1", "--key", "order-7")
    again = cli(db_url, "signal", run_id, "go", "--payload", "1", "--key", "order-7")
    assert (first.returncode, first.stdout.strip()) == (0, "signalled"), first.stderr
    assert (again.returncode, again.stdout.strip()) == (0, "already signalled with this key"), again.stderr
    assert sorted(t.state for t in engine.get_run(run_id).tasks) == ["COMPLETED", "WAITING"]
    bad = cli(db_url, "signal", run_id, "go", "--key", "")
    assert bad.returncode == 2 and "signal key" in bad.stderr and bad.stderr.count("\n") == 1
