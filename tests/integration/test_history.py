"""A run's history: what happened to it, written with each change, shown by
``composer-ops runs show`` (with every attempt read from it) and the run investigation
report; operator actions in the history of the runs they changed; and
``composer-ops signal --key``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.core.actor import Actor
from composer_ops.testing.processes import Fleet, wait_for

ROOT = Path(__file__).resolve().parents[2]


def cli(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COMPOSER_DATABASE_URL": db_url, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "composer_ops", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.timeout(360)          # three worker and coordinator processes, and a CLI
def test_the_history_of_a_run_that_lived_through_a_killed_worker(engine: Engine, db_url: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A worker process is SIGKILLed holding the task; its lease lapses, a coordinator
    re-queues it (the default policy: no retry of handler failures), a second worker
    finishes it. The history names the dead worker, the expiry and who finished;
    ``runs show`` lists both attempts, the first ended by the killed worker's expired
    lease, naming it; ``workers list`` says that worker (its pid) is dead; the run
    investigation report's key figures (what nbval checks) name the lost lease and
    its owner."""
    engine.deploy({"id": "killed", "nodes": [{"id": "slow", "type": "TASK", "task": "work", "lease_s": 1,
                                              "input": {"sleep": "$.input.sleep"}}]})
    run_id = engine.start("killed", input={"sleep": 30})
    fleet = Fleet(db_url)
    try:
        doomed = fleet.worker("--registry-interval", "0.5", concurrency=1)
        wait_for(lambda: engine.get_run(run_id).tasks[0].state == "RUNNING", timeout=120, what="the claim")
        fleet.kill(doomed)
        with engine.pool.connection() as conn:     # the next attempt is quick
            conn.execute("UPDATE task_instances SET input_json = '{\"sleep\": 0}' WHERE run_id = %s", (run_id,))
        fleet.coordinator()
        fleet.worker(concurrency=1)
        wait_for(lambda: engine.get_run(run_id).status != "RUNNING", timeout=120, what="the run to finish")
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
    first, second = doc["attempts"]
    assert (first["node_id"], first["attempt"], first["worker"], first["outcome"], first["requeued"]) == (
        "slow", 0, owner, "lease expired", True)
    assert first["error"].startswith(f"lease of {owner} expired") and first["ended_at"] >= first["claimed_at"]
    assert (second["attempt"], second["outcome"], second["requeued"]) == (1, "completed", None)
    assert second["worker"] == rows[3][2] and second["task_id"] == first["task_id"]
    (task_line,) = [line for line in lines if line.startswith("slow ")]
    assert "COMPLETED" in task_line and f"an earlier attempt's error: lease of {owner}" in task_line
    listed = lines[lines.index("attempts:") + 1:start]
    assert len(listed) == 2 and owner in listed[0] and "lease expired (re-queued)" in listed[0], listed
    assert "completed" in listed[1]

    workers = cli(db_url, "workers", "list", "--json")
    assert workers.returncode == 0, workers.stderr
    registry = {w["id"]: w for w in json.loads(workers.stdout)["workers"]}
    assert registry[owner]["state"] == "dead" and registry[owner]["pid"] == doomed.pid

    out = tmp_path / "reports"
    assert main(["report", "run_investigation", "--out", str(out), "--database-url", db_url, "--progress", "0",
                 "-p", "run_id", run_id]) == 0, capsys.readouterr().err
    figures = json.loads(next((out / "run_investigation").glob("*.json")).read_text())["key_figures"]
    assert figures["lost_leases"] == [["slow", 0, owner]]
    assert figures["attempts"] == 2 and figures["self_checks_failed"] == []
    assert figures["history"] == {"claimed": 2, "completed": 1, "lease_expired": 1, "started": 1}
    page = next((out / "run_investigation").glob("*.html")).read_text(encoding="utf-8")
    assert f"slow attempt 0 held by {owner}" in page


def test_signals_timers_and_cancels_are_in_the_history(engine: Engine) -> None:
    engine.deploy({"id": "mixed", "nodes": [
        {"id": "nap", "type": "WAIT", "duration_s": 0},
        {"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["nap"]},
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


def test_tasks_a_failure_cancels_are_in_the_history_and_their_attempts_end(
        engine: Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A node failing the run cancels the tasks still running (and a failing MAP item
    its node's other items): their history row says so, and ``runs show`` ends their
    attempts as cancelled. Before, nothing was written and the attempts read 'running'
    for good."""
    from composer_ops.core.attempts import attempts

    engine.deploy({"id": "pair", "nodes": [{"id": "fast", "type": "TASK", "task": "fast"},
                                           {"id": "slow", "type": "TASK", "task": "slow"}]})
    engine.deploy({"id": "fan", "nodes": [{"id": "m", "type": "MAP", "task": "item", "items": "$.input.xs"}]})
    run_id = engine.start("pair")
    claimed = {c.node_id: c for c in engine.claim(["default"], "w1", 10)}
    engine.fail(claimed["fast"], "no", retryable=False)
    fan = engine.start("fan", input={"xs": [1, 2, 3]})
    items = engine.claim(["default"], "w1", 10)
    assert len(items) == 3
    engine.fail(items[0], "bad item", retryable=False)
    for rid, node, count in ((run_id, "slow", 1), (fan, "m", 2)):
        run = engine.get_run(rid)
        assert run.status == "FAILED", run
        (row,) = [h for h in run.history if h.kind == "cancelled"]
        assert row.detail["tasks"] == count and row.detail["nodes"] == [node], row.detail
        assert "failed" in row.detail["reason"], row.detail
        ended = {(a.node_id, a.outcome) for a in attempts(run.history)}
        assert "running" not in {o for _, o in ended}, ended
        assert (node, "cancelled") in ended, ended
    assert main(["runs", "show", run_id, "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert " running" not in out and "cancelled" in out, out
    assert '\nerror: node "fast" failed after 1 attempt: no\n' in out and "{'error'" not in out, out   # text
    assert main(["runs", "show", fan, "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert "  m[0] " in out and "  m[1] " in out, out         # which item each attempt was


def test_the_cli_signal_key_resolves_at_most_one_node(engine: Engine, db_url: str) -> None:
    engine.deploy({"id": "twice", "nodes": [{"id": "w1", "type": "WAIT_FOR_SIGNAL", "signal": "go"},
                                            {"id": "w2", "type": "WAIT_FOR_SIGNAL", "signal": "go"}]})
    run_id = engine.start("twice")
    first = cli(db_url, "signal", run_id, "go", "--payload", "1", "--key", "order-7")
    again = cli(db_url, "signal", run_id, "go", "--payload", "1", "--key", "order-7")
    assert (first.returncode, first.stdout.strip()) == (0, "signalled"), first.stderr
    assert (again.returncode, again.stdout.strip()) == (0, "already signalled with this key"), again.stderr
    assert sorted(t.state for t in engine.get_run(run_id).tasks) == ["COMPLETED", "WAITING"]
    bad = cli(db_url, "signal", run_id, "go", "--key", "")
    assert bad.returncode == 2 and "signal key" in bad.stderr and bad.stderr.count("\n") == 1


def _audit(db_url: str, action: str) -> list[tuple[str, str | None]]:
    with psycopg.connect(db_url) as conn:
        return [(str(r[0]), r[1]) for r in conn.execute(
            "SELECT request, target FROM operator_audit WHERE action = %s ORDER BY id", (action,))]


def test_operator_actions_are_in_the_history_of_the_runs_they_changed(engine: Engine, db_url: str) -> None:
    """A bulk cancel, a retry and a delete each write a row in the history of the run
    they changed, in the same transaction as the change and its audit row, naming the
    command; the history row and the audit row share the request. The attempts
    before a retry stay in the history although the retry replaced the task."""
    engine.deploy({"id": "ops", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    who = Actor(command="composer-ops runs retry RUN --yes", host="ops-host")

    failing = engine.start("ops", input={"k": "retry"})
    [claim] = engine.claim(["default"], "w-one", 1)
    assert engine.fail(claim, "boom", retryable=False).finished == "FAILED"
    retried = engine.retry(failing, yes=True, actor=who)
    assert retried.reset == ("a",)
    [again] = engine.claim(["default"], "w-two", 1)
    assert engine.complete(again, "ok").finished == "SUCCEEDED"
    run = engine.get_run(failing)
    row = next(h for h in run.history if h.kind == "retried")
    assert row.detail["operator"] == {"action": "runs retry", "command": who.command, "host": "ops-host"}
    assert [(row.request, failing)] == _audit(db_url, "runs retry")
    shown = cli(db_url, "runs", "show", failing, "--json")
    attempts = json.loads(shown.stdout)["attempts"]
    assert [(a["worker"], a["outcome"]) for a in attempts] == [("w-one", "failed"), ("w-two", "completed")]
    assert attempts[0]["task_id"] != attempts[1]["task_id"]          # the retry made a new task
    text = cli(db_url, "runs", "show", failing).stdout
    assert "retried" in text and f"[operator: {who.command} on ops-host]" in text

    active = engine.start("ops", input={"k": "cancel"})
    done = engine.cancel_runs(where="input.k=cancel", yes=True, actor=Actor(command="composer-ops runs cancel",
                                                                             host="ops-host"))
    assert done.cancelled == [active]
    row = next(h for h in engine.get_run(active).history if h.kind == "cancelled")
    assert row.detail["operator"]["action"] == "runs cancel"
    assert [r for r, _ in _audit(db_url, "runs cancel")] == [row.request]

    engine.delete_run(active, actor=Actor(command="composer-ops runs delete RUN --yes", host="ops-host"))
    with psycopg.connect(db_url) as conn:
        kind, detail, request = conn.execute(
            "SELECT kind, detail, request FROM run_history WHERE run_id = %s ORDER BY seq DESC LIMIT 1",
            (active,)).fetchone()  # type: ignore[misc]
    assert kind == "deleted" and detail["status"] == "CANCELLED" and detail["operator"]["action"] == "runs delete"
    assert [(request, active)] == _audit(db_url, "runs delete")


def test_a_dry_run_writes_no_history(engine: Engine, db_url: str) -> None:
    engine.deploy({"id": "dry", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    run_id = engine.start("dry", input={"k": "dry"})
    before = [h.seq for h in engine.get_run(run_id).history]
    assert engine.cancel_runs(where="input.k=dry").would_cancel == [run_id]
    [claim] = engine.claim(["default"], "w", 1)
    engine.fail(claim, "boom", retryable=False)
    after_fail = [h.seq for h in engine.get_run(run_id).history]
    assert len(after_fail) == len(before) + 2                       # claimed, failed
    assert engine.retry(run_id, yes=False).applied is False
    assert [h.seq for h in engine.get_run(run_id).history] == after_fail
