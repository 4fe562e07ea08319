"""The chaos run's audit: what the database holds after the faults, against what the
driver did. Every check appends a line to ``problems``; the run passes when none.

Re-queues are read from ``chaos_transitions``, filled by an audit trigger the driver
installs on task_instances (the engine keeps only a task's last error; the trigger
keeps every transition with its reason and the lease owner it took the task from).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import psycopg

from composer_ops.testing.processes import Kill
from tests.chaos.hook import Hook
from tests.chaos.workload import LEASE_S, Planned, injected_failures

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")

AUDIT_SQL = """
CREATE TABLE chaos_transitions(
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id TEXT, task_id TEXT, node_id TEXT, old_state TEXT, new_state TEXT,
    old_attempt INT, new_attempt INT, old_owner TEXT, new_owner TEXT, reason TEXT,
    at DOUBLE PRECISION NOT NULL DEFAULT extract(epoch FROM clock_timestamp()));
CREATE FUNCTION chaos_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_transitions(run_id, task_id, node_id, old_state, new_state, old_attempt, new_attempt,
                                  old_owner, new_owner, reason)
    VALUES (NEW.run_id, NEW.id, NEW.node_id, OLD.state, NEW.state, OLD.attempt, NEW.attempt,
            OLD.lease_owner, NEW.lease_owner, NEW.last_error ->> 'error');
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_audit AFTER UPDATE ON task_instances FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.attempt IS DISTINCT FROM NEW.attempt)
    EXECUTE FUNCTION chaos_audit();
"""

#: The same on a Citus coordinator, statement by statement (Citus propagates the function
#: and the trigger to the worker nodes one command at a time): the transitions are kept
#: beside their tasks (a table distributed and co-located by run ID), so the trigger,
#: which fires on the worker node holding the task's shard, writes them there. Citus
#: refuses triggers on distributed tables unless citus.enable_unsafe_triggers is on:
#: ordering across shards is not guaranteed, which this audit does not need.
AUDIT_SQL_CITUS = [
    "SET LOCAL citus.enable_unsafe_triggers TO on",
    "SET LOCAL citus.multi_shard_modify_mode TO sequential",
    AUDIT_SQL[:AUDIT_SQL.index("CREATE FUNCTION")].strip().rstrip(";")
    .replace("id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,\n    run_id TEXT,",
             "id BIGINT GENERATED ALWAYS AS IDENTITY,\n    run_id TEXT COLLATE \"C\" NOT NULL,"),
    "SELECT create_distributed_table('chaos_transitions', 'run_id', colocate_with => 'workflow_runs')",
    AUDIT_SQL[AUDIT_SQL.index("CREATE FUNCTION"):AUDIT_SQL.index("CREATE TRIGGER")].strip().rstrip(";"),
    AUDIT_SQL[AUDIT_SQL.index("CREATE TRIGGER"):].strip().rstrip(";"),
]


@dataclass
class Audit:
    problems: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def problem(self, text: str) -> None:
        if len(self.problems) < 200:
            self.problems.append(text)


def owner_pid(owner: str | None) -> int | None:
    parts = (owner or "").split(":")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None


def audit(conn: psycopg.Connection[Any], started: dict[str, Planned], sent: dict[str, list[str]],
          kills: list[Kill], restarts: list[tuple[float, float]], hook: Hook) -> Audit:
    """Check everything the issue promises; fill the figures."""
    a = Audit()
    runs = {r[0]: (r[1], r[2]) for r in conn.execute(
        "SELECT id, workflow_definition_id, status FROM workflow_runs")}
    tasks: dict[str, dict[str, list[tuple[str, int, Any]]]] = defaultdict(lambda: defaultdict(list))
    for run_id, node_id, state, attempt, output in conn.execute(
            "SELECT run_id, node_id, state, attempt, output_json FROM task_instances"):
        tasks[run_id][node_id].append((state, attempt, output))
    _check_runs(a, started, runs, tasks)
    _check_signals(a, conn, started, sent, tasks)
    _check_leftovers(a, conn)
    _check_webhooks(a, conn, started, runs, hook)
    _check_requeues(a, conn, started, kills, restarts)
    _check_history(a, conn)
    a.figures["runs"] = len(started)
    a.figures["by_status"] = dict(Counter(status for _wf, status in runs.values()))
    return a


def _check_runs(a: Audit, started: dict[str, Planned], runs: dict[str, tuple[str, str]],
                tasks: dict[str, dict[str, list[tuple[str, int, Any]]]]) -> None:
    for run_id in sorted(set(runs) - set(started)):
        a.problem(f"run {run_id} exists but was never started by the driver (a duplicate start?)")
    for run_id, want in started.items():
        if run_id not in runs:
            a.problem(f"run {run_id} ({want.workflow}) was started but is missing")
            continue
        wf, status = runs[run_id]
        if wf != want.workflow or status != want.status:
            a.problem(f"run {run_id} ({wf}) is {status}, expected {want.status}")
        nodes = tasks.get(run_id, {})
        doubled = sorted(n for n, rows in nodes.items() if len(rows) != 1)
        if doubled:
            a.problem(f"run {run_id}: more than one task row for {doubled}")
        if set(nodes) != want.reached:
            a.problem(f"run {run_id} ({wf}): reached {sorted(nodes)}, expected {sorted(want.reached)}")
        for node_id, state in want.states.items():
            got = nodes.get(node_id, [("NOT REACHED", 0, None)])[0][0]
            if got != state:
                a.problem(f"run {run_id} ({wf}): node {node_id} is {got}, expected {state}")
    a.figures["task_rows"] = sum(len(rows) for nodes in tasks.values() for rows in nodes.values())


def _check_signals(a: Audit, conn: psycopg.Connection[Any], started: dict[str, Planned], sent: dict[str, list[str]],
                   tasks: dict[str, dict[str, list[tuple[str, int, Any]]]]) -> None:
    events: dict[str, list[tuple[str | None, bool]]] = defaultdict(list)
    for run_id, payload, consumed in conn.execute(
            "SELECT run_id, payload, consumed_at IS NOT NULL FROM workflow_events"):
        events[run_id].append(((payload or {}).get("sig"), bool(consumed)))
    lost = doubled = buffered = 0
    for run_id, want in started.items():
        if not want.signals:
            if events.get(run_id):
                a.problem(f"run {run_id}: has signals though none were sent")
            continue
        ids = sent.get(run_id, [])
        if len(ids) != want.signals:
            a.problem(f"run {run_id}: the driver sent {len(ids)} of {want.signals} signals")
        consumers = Counter((rows[0][2] or {}).get("sig") for node, rows in tasks.get(run_id, {}).items()
                            if node in ("w1", "w2") and rows[0][0] == "COMPLETED")
        for sig in ids:
            if consumers[sig] == 0:
                lost += 1
                a.problem(f"run {run_id}: signal {sig} was sent but resolved no node")
            elif consumers[sig] > 1:
                doubled += 1
                a.problem(f"run {run_id}: signal {sig} resolved {consumers[sig]} nodes")
        for stored, consumed in events.get(run_id, []):
            buffered += 1
            if not consumed:
                a.problem(f"run {run_id}: buffered signal {stored} was never consumed")
            if stored not in ids:
                doubled += 1
                a.problem(f"run {run_id}: buffered signal {stored} was not sent by the driver (delivered twice?)")
    a.figures["signals"] = {"sent": sum(len(v) for v in sent.values()), "buffered_first": buffered,
                            "lost": lost, "doubled": doubled}


def _check_leftovers(a: Audit, conn: psycopg.Connection[Any]) -> None:
    row: Any = conn.execute("""SELECT (SELECT count(*) FROM task_outbox),
                                      (SELECT count(*) FROM task_instances t JOIN workflow_runs r ON r.id = t.run_id
                                        WHERE r.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
                                          AND t.state IN ('PENDING', 'QUEUED', 'RUNNING', 'WAITING'))""").fetchone()
    if row[0]:
        a.problem(f"{row[0]} dispatches are left in task_outbox")
    if row[1]:
        a.problem(f"{row[1]} tasks of finished runs are still active")


def _check_webhooks(a: Audit, conn: psycopg.Connection[Any], started: dict[str, Planned],
                    runs: dict[str, tuple[str, str]], hook: Hook) -> None:
    rows = {r[0]: r[1:] for r in conn.execute(
        "SELECT run_id, delivered_at IS NOT NULL, gave_up_at IS NOT NULL, attempts FROM webhook_deliveries")}
    missing = 0
    for run_id in started:
        status = runs.get(run_id, ("", ""))[1]
        delivery = rows.get(run_id)
        statuses = [s for s in hook.received.get(run_id, []) if s]
        if delivery is None or not delivery[0] or status not in statuses:
            missing += 1
            a.problem(f"run {run_id} ({status}): webhook missing (row {delivery}, received {statuses})")
        elif any(s != status for s in statuses):
            a.problem(f"run {run_id}: webhook said {statuses}, the run is {status}")
    if hook.bad_signatures:
        a.problem(f"{hook.bad_signatures} webhook POSTs had a bad signature")
    dupes = sum(max(0, len([s for s in v if s]) - 1) for v in hook.received.values())
    a.figures["webhooks"] = {"delivered": sum(1 for r in rows.values() if r[0]), "posts": hook.posts,
                             "refused_first": sum(1 for v in hook.received.values() if v and v[0] == ""),
                             "duplicates": dupes, "torn_by_kills": hook.torn, "missing": missing}


def _check_requeues(a: Audit, conn: psycopg.Connection[Any], started: dict[str, Planned], kills: list[Kill],
                    restarts: list[tuple[float, float]]) -> None:
    """Every re-queue (attempt n -> n+1) must be an injected failure of attempt n, or
    the expiry of the lease of the worker that held attempt n. Expiries are then
    attributed: the owner was SIGKILLed before it, the server was restarting, or the
    owner was alive and missed its heartbeats (overload: explained, but counted)."""
    killed_at = {k.pid: k.at for k in kills if k.kind == "worker"}
    transitions = conn.execute("""
        SELECT run_id, task_id, node_id, old_state, new_state, old_attempt, new_attempt, old_owner, reason, at
          FROM chaos_transitions ORDER BY id""").fetchall()
    moved_on: dict[str, list[float]] = defaultdict(list)      # task -> when it was claimed again or finished
    for t in transitions:
        if t[4] in ("RUNNING", "COMPLETED", "FAILED", "CANCELLED"):
            moved_on[t[1]].append(t[9])
    causes: Counter[str] = Counter()
    detected: list[float] = []                                # kill -> re-queued (the sweeper's doing)
    running: list[float] = []                                 # kill -> claimed again (plus the queue's wait)
    for run_id, task_id, node_id, _old, _new, old_attempt, new_attempt, owner, reason, at in transitions:
        if new_attempt != old_attempt + 1:
            continue
        want = started.get(run_id)
        text = reason or ""
        if want and text == f"RuntimeError: transient failure on attempt {old_attempt}" and \
                injected_failures(want.workflow, node_id, want.input) > old_attempt:
            causes["injected failure"] += 1
            continue
        if not text.startswith(f"lease of {owner} expired at"):
            causes["unexplained"] += 1
            a.problem(f"task {task_id} ({node_id}) of run {run_id} re-queued {old_attempt}->{new_attempt} "
                      f"neither by an injected failure nor by its lease's expiry: {text!r}")
            continue
        kill = killed_at.get(owner_pid(owner) or -1)
        if kill is not None and kill <= at:
            causes["lease expired: worker killed"] += 1
            detected.append(at - kill)
            later = [x for x in moved_on[task_id] if x > at]
            if later:
                running.append(min(later) - kill)
        elif any(t0 - LEASE_S <= at <= t1 + LEASE_S + 10 for t0, t1 in restarts):
            causes["lease expired: server restart"] += 1
        else:
            causes["lease expired: worker alive, heartbeats late"] += 1
    a.figures["requeues"] = dict(causes)
    a.figures["recovery_after_worker_kill_s"] = {
        "requeued_median": _median(detected), "requeued_max": _max(detected),
        "running_again_median": _median(running), "running_again_max": _max(running)}
    if restarts:
        t0, t1 = restarts[0]
        after = [t[9] for t in transitions if t[4] == "COMPLETED" and t[9] > t1]
        a.figures["first_completion_after_restart_s"] = round(min(after) - t1, 2) if after else None


def _check_history(a: Audit, conn: psycopg.Connection[Any]) -> None:
    """No run failed by lease expiries alone, and the history agrees with the tasks:
    every re-queue left a 'failed' or 'lease_expired' row, every attempt that ran was
    claimed (a 'claimed' row naming a worker)."""
    failed_by_expiry = [r[0] for r in conn.execute(
        "SELECT id FROM workflow_runs WHERE status = 'FAILED' AND error_json->>'error' LIKE '%max_lease_expiries%'")]
    for run_id in failed_by_expiry[:20]:
        a.problem(f"run {run_id} failed by lease expiries alone")
    a.figures["failed_by_lease_expiry"] = len(failed_by_expiry)
    rows = conn.execute("""
        SELECT t.run_id, t.node_id, t.state, t.attempt,
               (SELECT count(*) FROM run_history h WHERE h.run_id = t.run_id AND h.task_id = t.id
                   AND h.kind IN ('failed', 'lease_expired') AND (h.detail->>'requeued')::boolean),
               (SELECT count(*) FROM run_history h WHERE h.run_id = t.run_id AND h.task_id = t.id
                   AND h.kind = 'claimed' AND h.worker IS NOT NULL)
          FROM task_instances t WHERE t.node_type = 'TASK'""").fetchall()
    for run_id, node_id, state, attempt, requeues, claims in rows:
        if requeues != attempt:
            a.problem(f"run {run_id} node {node_id}: attempt {attempt} but {requeues} re-queues in its history")
        if state in ("COMPLETED", "FAILED") and claims == 0:
            a.problem(f"run {run_id} node {node_id} is {state} but its history has no claim")
    a.figures["history"] = {"tasks": len(rows), "claims": sum(r[5] for r in rows)}


def _median(values: list[float]) -> float | None:
    return round(sorted(values)[len(values) // 2], 2) if values else None


def _max(values: list[float]) -> float | None:
    return round(max(values), 2) if values else None


def describe_stuck(conn: psycopg.Connection[Any], run_ids: list[str]) -> str:
    """A few unfinished runs with their task states, for the failure message."""
    lines = []
    for run_id in run_ids[:5]:
        rows = conn.execute("SELECT node_id, state, attempt, lease_owner FROM task_instances WHERE run_id = %s",
                            (run_id,)).fetchall()
        lines.append(f"{run_id}: {json.dumps(rows, default=str)}")
    return "\n".join(lines)
