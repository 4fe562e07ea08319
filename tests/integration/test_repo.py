"""Every repository statement against a real server, fences included."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from composer_ops.core.model import TaskRef
from composer_ops.core.runids import month_of
from composer_ops.errors import Conflict, Invalid, NotFound
from composer_ops.repo import clock, definitions, history, outbox, runs, signals, tasks, webhooks, writes
from composer_ops.repo.rows import Dispatch, HistoryEntry, NewTask, StartTarget
from tests.integration.helpers import add_definition, add_run, now_utc

NOTE = HistoryEntry(kind="note")


@pytest.fixture
def run_id(conn: Any) -> str:
    add_definition(conn)
    return add_run(conn)


def _task(conn: Any, run_id: str, node: str = "a", state: str = "PENDING", **kw: Any) -> str:
    task_id = f"{run_id[:8]}-{node}"
    assert tasks.insert_task(conn, run_id, task_id=task_id, node_id=node, node_type=kw.pop("node_type", "TASK"),
                             queue="default", state=state, now=clock.now(conn), **kw)
    return task_id


def _ref(run_id: str, task_id: str, node: str = "a", attempt: int = 0) -> TaskRef:
    return TaskRef(task_id=task_id, run_id=run_id, node_id=node, attempt=attempt)


def _write(conn: Any, run_id: str, **parts: Any) -> None:
    """An event's one write (repo/writes.py) of ``parts``, decided now."""
    writes.send(conn, writes.document(at=clock.now(conn), run_id=run_id, request="r", **parts)).result()


def _complete(conn: Any, ref: TaskRef) -> None:
    _write(conn, ref.run_id, done=[writes.Done(ref=ref, output=None, entry=NOTE)])


def _state(conn: Any, run_id: str, node: str = "a") -> tuple[str, int]:
    row = conn.execute("SELECT state, attempt FROM task_instances WHERE run_id = %s AND node_id = %s",
                       (run_id, node)).fetchone()
    return row[0], row[1]


def test_lock_and_load_reads_the_row_and_the_db_clock_and_holds_the_lock(conn: Any, run_id: str,
                                                                          db_url: str) -> None:
    conn.commit()
    row, loaded = runs.lock_and_load(conn, run_id)
    assert (row.workflow_id, row.workflow_version, row.status) == ("wf", 1, "RUNNING")
    assert row.context is None                                   # read on first use, under the lock:
    assert runs.load_context(conn, run_id) == {"input": {"x": 1}, "config": {}}
    assert abs(row.now - now_utc()) < timedelta(seconds=5)
    assert loaded == {}
    with psycopg.connect(db_url) as other:                       # the row lock is held until commit
        with pytest.raises(psycopg.errors.LockNotAvailable):
            other.execute("SELECT 1 FROM workflow_runs WHERE id = %s FOR UPDATE NOWAIT", (run_id,))
    conn.rollback()
    with pytest.raises(NotFound, match="does not exist"):
        runs.lock_and_load(conn, "0190f0c0-0000-7000-8000-000000000000")


def test_lock_and_load_sees_what_the_locks_previous_holder_committed(db_url: str) -> None:
    """One transaction holds a run's lock, completes its task and creates the next; a
    second event's lock_and_load waits for that lock meanwhile. Once the first commits,
    the second sees both writes: its tasks are read after its lock was granted, not with
    a snapshot from before it waited (the join race the run lock prevents)."""
    from composer_ops.db.errors import TranslatingConnection

    with (TranslatingConnection.connect(db_url, autocommit=True) as setup,
          TranslatingConnection.connect(db_url) as first, TranslatingConnection.connect(db_url) as second):
        add_definition(setup)
        run_id = add_run(setup)
        task_a = _task(setup, run_id, "a", state="RUNNING")
        runs.lock_and_load(first, run_id)
        _complete(first, _ref(run_id, task_a))
        _task(first, run_id, "b")
        found: list[Any] = []
        waiter = threading.Thread(target=lambda: found.append(runs.lock_and_load(second, run_id)))
        waiter.start()
        deadline = time.monotonic() + 60
        while setup.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                            (second.info.backend_pid,)).fetchone() != ("Lock",):
            assert time.monotonic() < deadline, "the second event never waited for the run's lock"
            time.sleep(0.02)
        first.commit()
        waiter.join(60)
        assert found, "the second event did not get the lock"
        (_, loaded), = found
        second.rollback()
    assert set(loaded) == {"a", "b"}
    assert (loaded["a"].state, loaded["b"].state) == ("COMPLETED", "PENDING")


def test_insert_run_twice_is_conflict(conn: Any, run_id: str) -> None:
    with pytest.raises(Conflict, match="already exists"):
        runs.insert_run(conn, run_id=run_id, workflow_id="wf", workflow_version=1, input=None, context={},
                        now=clock.now(conn))
    assert conn.execute("SELECT count(*) FROM workflow_runs").fetchone()[0] == 1


def test_insert_run_needs_a_live_definition(conn: Any) -> None:
    with pytest.raises(NotFound, match="wf v1"):
        add_run(conn)
    add_definition(conn)
    definitions.soft_delete(conn, "wf")
    with pytest.raises(Invalid, match="has been deleted"):
        add_run(conn)


def test_load_tasks_and_outputs(conn: Any, run_id: str) -> None:
    _task(conn, run_id, "a", state="COMPLETED", output={"tier": "gold"})
    _task(conn, run_id, "w", state="WAITING", node_type="WAIT_FOR_SIGNAL", signal_name="go")
    _task(conn, run_id, "s", state="COMPLETED", node_type="SWITCH", branches=["x"])
    _, loaded = runs.lock_and_load(conn, run_id)
    assert set(loaded) == {"a", "w", "s"}
    assert loaded["w"].signal_name == "go" and loaded["a"].signal_name is None
    assert loaded["s"].branches == ("x",)
    assert runs.load_outputs(conn, run_id, ["a", "w"]) == {"a": {"tier": "gold"}}
    assert runs.load_outputs(conn, run_id, []) == {}


def test_insert_tasks_and_enqueue_write_every_column_as_given(conn: Any, run_id: str) -> None:
    """The rows travel as one JSON document (``_base.recordset``): falsy JSON stays
    itself, None is SQL NULL, a timestamp with an offset is the same instant to the
    microsecond, text needing escapes arrives intact."""
    from datetime import timezone

    from composer_ops.repo.rows import NewTask

    now = clock.now(conn)
    wake = (now + timedelta(hours=1)).astimezone(timezone(timedelta(hours=5, minutes=30)))
    rows = [NewTask(task_id=f"{run_id[:8]}-{i}", node_id=node, node_type="TASK", queue=queue, state="PENDING",
                    input=value) for i, (node, queue, value) in enumerate(
                        [("zero", "default", 0), ("empty", "default", ""), ("list", None, []),
                         ("false", "default", False), ("none", "default", None),
                         ('q"uo\\te', "default", {"k": ['é', None, 1.5]})])]
    rows.append(NewTask(task_id=f"{run_id[:8]}-w", node_id="w", node_type="WAIT", queue=None, state="WAITING",
                        wake_at=wake, signal_name="go", branches=["x", "y"], error="boom", output={"o": 1}))
    tasks.insert_tasks(conn, run_id, rows, now=now)
    got = {r[0]: r[1:] for r in conn.execute(
        "SELECT node_id, input_json, input_json IS NULL, queue, wake_at, signal_name, branches, last_error,"
        " output_json, scheduled_at FROM task_instances WHERE run_id = %s", (run_id,))}
    assert got["zero"][:3] == (0, False, "default") and got["empty"][:2] == ("", False)
    assert got["list"][:3] == ([], False, None) and got["false"][:2] == (False, False)
    assert got["none"][:2] == (None, True)
    assert got['q"uo\\te'][0] == {"k": ['é', None, 1.5]}
    assert got["w"][3:] == (wake, "go", ["x", "y"], {"error": "boom"}, {"o": 1}, now)
    later = now + timedelta(seconds=90)
    outbox.enqueue(conn, [Dispatch(run_id=run_id, task_id=rows[0].task_id, attempt=3, queue="q1", task_name="t1",
                                   lease_s=17, available_at=later.astimezone(wake.tzinfo)),
                          Dispatch(run_id=run_id, task_id=rows[1].task_id, attempt=0, queue="q2", task_name="t2",
                                   lease_s=30)], now=now)
    assert conn.execute("SELECT task_id, attempt, queue, task_name, lease_s, available_at, created_at"
                        " FROM task_outbox ORDER BY task_id").fetchall() == [
        (rows[0].task_id, 3, "q1", "t1", 17, later, now), (rows[1].task_id, 0, "q2", "t2", 30, now, now)]


def test_insert_task_twice_for_one_node_is_a_conflict_that_writes_nothing(conn: Any, run_id: str) -> None:
    _task(conn, run_id)
    conn.commit()
    with pytest.raises(Conflict, match=r"\(run_id, node_id\)=\([^)]*, a\) already exists"):
        tasks.insert_tasks(conn, run_id, [
            NewTask(task_id="new-b", node_id="b", node_type="TASK", queue=None, state="PENDING"),
            NewTask(task_id="other", node_id="a", node_type="TASK", queue=None, state="PENDING")],
            now=clock.now(conn))
    conn.rollback()
    assert conn.execute("SELECT count(*) FROM task_instances WHERE run_id = %s", (run_id,)).fetchone()[0] == 1


def test_a_fenced_completion_that_misses_rolls_the_event_back(conn: Any, run_id: str) -> None:
    task_id = _task(conn, run_id)
    conn.commit()
    for ref in (_ref(run_id, task_id, attempt=7), _ref(run_id, task_id, node="zzz")):
        with pytest.raises(Conflict, match="fenced write matched no row"):
            _write(conn, run_id, done=[writes.Done(ref=ref, output=1, entry=NOTE)],
                   history=[HistoryEntry(kind="other")])
        conn.rollback()
    assert _state(conn, run_id) == ("PENDING", 0)
    assert history.run_history(conn, run_id) == []
    _complete(conn, _ref(run_id, task_id))
    assert _state(conn, run_id) == ("COMPLETED", 0)
    assert [(h.kind, h.task_id, h.request) for h in history.run_history(conn, run_id)] == [("completed", task_id, "r")]


def test_insert_task_terminal_states_stamp_times(conn: Any, run_id: str) -> None:
    _task(conn, run_id, "a", state="SKIPPED")
    row = conn.execute("SELECT finished_at IS NOT NULL, completed_at IS NULL FROM task_instances"
                       " WHERE run_id = %s", (run_id,)).fetchone()
    assert row == (True, True)


def _fail(conn: Any, ref: TaskRef, reason: str, *, requeue: bool = False, lease_expired: bool = False) -> None:
    _write(conn, ref.run_id, failed=[writes.Fail(ref=ref, reason=reason, entry=NOTE, requeue=requeue,
                                                 lease_expired=lease_expired)])


@pytest.mark.parametrize("op", ["fail", "requeue"])
def test_fenced_updates_refuse_stale_attempt_and_finished_task(conn: Any, run_id: str, op: str) -> None:
    task_id = _task(conn, run_id)
    conn.commit()

    def apply(ref: TaskRef) -> bool:
        try:
            _fail(conn, ref, "boom", requeue=op == "requeue")
        except Conflict as exc:
            assert "fenced write matched no row" in str(exc)
            conn.rollback()
            return False
        conn.commit()
        return True

    assert not apply(_ref(run_id, task_id, attempt=7))          # stale attempt
    assert not apply(_ref(run_id, task_id, node="zzz"))         # wrong node
    assert _state(conn, run_id) == ("PENDING", 0)
    assert apply(_ref(run_id, task_id))
    after = _state(conn, run_id)
    if after[0] == "PENDING":                    # re-queued: complete the next attempt
        _complete(conn, _ref(run_id, task_id, attempt=after[1]))
        conn.commit()
    final = _state(conn, run_id)
    assert not apply(_ref(run_id, task_id, attempt=after[1]))  # finished task
    assert _state(conn, run_id) == final
    # A history row for each update that matched, none for those that did not.
    assert [h.kind for h in history.run_history(conn, run_id)] == ["note", "completed"] if op == "requeue" \
        else ["note"]


def test_requeue_bumps_attempt_and_counts_a_lost_lease(conn: Any, run_id: str) -> None:
    task_id = _task(conn, run_id, input={"n": 3})
    _fail(conn, _ref(run_id, task_id), "flaky", requeue=True)
    row = conn.execute("SELECT attempt, state, last_error, input_json FROM task_instances WHERE id = %s",
                       (task_id,)).fetchone()
    assert row == (1, "PENDING", {"error": "flaky"}, {"n": 3})
    _fail(conn, _ref(run_id, task_id, attempt=1), "lapsed", requeue=True, lease_expired=True)
    row = conn.execute("SELECT attempt, lease_expiries FROM task_instances WHERE id = %s", (task_id,)).fetchone()
    assert row == (2, 1)


def test_finish_run_once(conn: Any, run_id: str) -> None:
    _write(conn, run_id, finish=writes.Finish(status="SUCCEEDED", reason=None, output={"a": 1}))
    conn.commit()
    with pytest.raises(Conflict, match="finished concurrently"):
        _write(conn, run_id, finish=writes.Finish(status="FAILED", reason="late", output=None))
    conn.rollback()
    view = runs.get_run(conn, run_id)
    assert (view.status, view.output, view.error) == ("SUCCEEDED", {"a": 1}, None)


def test_due_waits_and_resolve_wait(conn: Any, run_id: str) -> None:
    past = now_utc() - timedelta(seconds=5)
    future = now_utc() + timedelta(hours=1)
    due = _task(conn, run_id, "w1", state="WAITING", node_type="WAIT", wake_at=past)
    _task(conn, run_id, "w2", state="WAITING", node_type="WAIT", wake_at=future)
    assert [w.task_id for w in signals.due_waits(conn, 10, now=clock.now(conn))] == [due]
    conn.commit()
    _write(conn, run_id, resolved=[writes.Resolve(task_id=due, state="COMPLETED", output={"ok": True})])
    conn.commit()
    with pytest.raises(Conflict, match=r"fenced write matched no row \(ResolveWait\)"):
        _write(conn, run_id, resolved=[writes.Resolve(task_id=due, state="FAILED", reason="late")])
    conn.rollback()
    assert _state(conn, run_id, "w1") == ("COMPLETED", 0)
    row = conn.execute("SELECT output_json, completed_at IS NOT NULL FROM task_instances WHERE id = %s",
                       (due,)).fetchone()
    assert row == ({"ok": True}, True)
    assert signals.due_waits(conn, 10, now=clock.now(conn)) == []


def test_signals_buffer_oldest_first_and_consume_once(conn: Any, run_id: str) -> None:
    assert signals.pending_signals(conn, run_id, "go") == []
    signals.buffer_signal(conn, run_id, signal_id="s1", name="go", payload={"n": 1}, now=clock.now(conn))
    signals.buffer_signal(conn, run_id, signal_id="s2", name="go", payload={"n": 2}, now=clock.now(conn))
    signals.buffer_signal(conn, run_id, signal_id="s3", name="other", payload=None, now=clock.now(conn))
    first, second = signals.pending_signals(conn, run_id, "go")
    assert (first.id, first.payload, second.id) == ("s1", {"n": 1}, "s2")
    assert signals.pending_signals(conn, run_id, "go", limit=1) == [first]
    assert signals.consume_signal(conn, run_id, "s1", now=clock.now(conn)) is True
    assert signals.consume_signal(conn, run_id, "s1", now=clock.now(conn)) is False
    assert [s.id for s in signals.pending_signals(conn, run_id, "go")] == ["s2"]


def test_definitions_versions_deploy_enable_delete(conn: Any) -> None:
    v1 = add_definition(conn, "flow")
    v2 = add_definition(conn, "flow")
    assert (v1, v2) == (1, 2)
    assert definitions.get_deployed(conn, "flow").version == 2
    definitions.deploy(conn, "flow", 1)
    assert definitions.get_deployed(conn, "flow").version == 1
    assert definitions.get_version(conn, "flow", 2).deployed is False
    definitions.set_enabled(conn, "flow", False)
    assert definitions.get_version(conn, "flow", 2).enabled is False
    with pytest.raises(NotFound):
        definitions.deploy(conn, "flow", 9)
    with pytest.raises(NotFound, match="deploy it first"):
        definitions.get_deployed(conn, "nope")
    definitions.soft_delete(conn, "flow")
    with pytest.raises(Invalid, match="no deployed version"):
        definitions.get_deployed(conn, "flow")
    assert definitions.get_version(conn, "flow", 1).deleted_at is not None


def test_a_start_reads_the_clock_and_its_definition_in_one_statement(conn: Any) -> None:
    add_definition(conn, "flow")
    add_definition(conn, "flow")
    definitions.deploy(conn, "flow", 1)
    now, target = definitions.clock_and_start_target(conn, "flow", None)
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None and now == row[0]           # the transaction's clock
    assert target == StartTarget(id="flow", version=1, enabled=True, deleted_at=None)
    assert definitions.clock_and_start_target(conn, "flow", 2)[1] == StartTarget(
        id="flow", version=2, enabled=True, deleted_at=None)
    assert definitions.clock_and_start_target(conn, "flow", 9)[1] is None
    assert definitions.clock_and_start_target(conn, "nope", None)[1] is None
    with pytest.raises(NotFound, match="flow v9 does not exist"):
        definitions.refuse_missing(conn, "flow", 9)
    with pytest.raises(NotFound, match="deploy it first"):
        definitions.refuse_missing(conn, "nope", None)
    definitions.soft_delete(conn, "flow")
    assert definitions.clock_and_start_target(conn, "flow", None)[1] is None
    deleted = definitions.clock_and_start_target(conn, "flow", 1)[1]
    assert deleted is not None and deleted.deleted_at is not None
    with pytest.raises(Invalid, match="no deployed version"):
        definitions.refuse_missing(conn, "flow", None)


def test_outbox_claim_moves_task_to_running_with_lease(conn: Any, run_id: str) -> None:
    task_id = _task(conn, run_id, input={"n": 1})
    later = _task(conn, run_id, "b")
    outbox.enqueue(conn, [
        Dispatch(run_id=run_id, task_id=task_id, attempt=0, queue="default", task_name="t", lease_s=30),
        Dispatch(run_id=run_id, task_id=later, attempt=0, queue="default", task_name="t", lease_s=30,
                 available_at=now_utc() + timedelta(hours=1)),
    ], now=clock.now(conn))
    assert outbox.claim(conn, ["other"], "w1", 10, claim_id="c") == []
    claims = outbox.claim(conn, ["default"], "w1", 10, claim_id="c")
    assert [(c.task_id, c.input, c.lease_owner, c.task_name) for c in claims] == [(task_id, {"n": 1}, "w1", "t")]
    assert _state(conn, run_id) == ("RUNNING", 0)
    assert outbox.claim(conn, ["default"], "w2", 10, claim_id="c") == []     # the delayed one is not yet available
    assert conn.execute("SELECT count(*) FROM task_outbox").fetchone()[0] == 1


def test_outbox_row_for_a_cancelled_task_claims_nothing(conn: Any, run_id: str) -> None:
    task_id = _task(conn, run_id)
    outbox.enqueue(conn, [Dispatch(run_id=run_id, task_id=task_id, attempt=0, queue="q", task_name="t",
                                   lease_s=5)], now=clock.now(conn))
    assert tasks.cancel_tasks(conn, run_id, [task_id], "cancelled", now=clock.now(conn)) == 1
    assert outbox.claim(conn, ["q"], "w", 5, claim_id="c") == []
    assert conn.execute("SELECT count(*) FROM task_outbox").fetchone()[0] == 0


def test_heartbeat_extends_only_a_live_lease(conn: Any, run_id: str) -> None:
    task_id = _task(conn, run_id)
    outbox.enqueue(conn, [Dispatch(run_id=run_id, task_id=task_id, attempt=0, queue="q", task_name="t",
                                   lease_s=1)], now=clock.now(conn))
    claim = outbox.claim(conn, ["q"], "w1", 1, claim_id="c")[0]
    ref = _ref(run_id, task_id)
    extended = tasks.heartbeat(conn, ref, "w1", 60)
    assert extended is not None and extended > claim.lease_expires_at
    assert tasks.heartbeat(conn, ref, "intruder", 60) is None
    conn.execute("UPDATE task_instances SET lease_expires_at = now() - interval '1 s' WHERE id = %s", (task_id,))
    assert tasks.heartbeat(conn, ref, "w1", 60) is None
    assert [e.task_id for e in tasks.expired_leases(conn, 10, now=clock.now(conn))] == [task_id]


def test_a_claim_records_its_id_and_claimed_by_finds_what_it_took(conn: Any, run_id: str) -> None:
    first, second = _task(conn, run_id, "a"), _task(conn, run_id, "b")
    outbox.enqueue(conn, [Dispatch(run_id=run_id, task_id=t, attempt=0, queue="default", task_name="job",
                                   lease_s=9) for t in (first, second)], now=clock.now(conn))
    taken = outbox.claim(conn, ["default"], "w1", 1, claim_id="claim-1")
    assert len(taken) == 1
    assert outbox.claimed_by(conn, "w1", "claim-1") == taken
    assert outbox.claimed_by(conn, "w2", "claim-1") == []          # another worker's
    assert outbox.claimed_by(conn, "w1", "claim-2") == []          # another claim
    [row] = history.run_history(conn, run_id)
    assert (row.kind, row.task_id, row.attempt, row.worker, row.request) == ("claimed", taken[0].task_id, 0, "w1",
                                                                             "claim-1")
    assert row.detail == {"task": "job", "lease_s": 9}
    _complete(conn, _ref(run_id, taken[0].task_id, node=taken[0].node_id))
    assert outbox.claimed_by(conn, "w1", "claim-1") == []          # no longer held


def test_history_rows_keep_their_order_and_request(conn: Any, run_id: str) -> None:
    history.record(conn, run_id, "req-1", [HistoryEntry(kind="one"), HistoryEntry(kind="two", detail={"x": 1})],
                   now=clock.now(conn))
    history.record(conn, run_id, "req-2", [HistoryEntry(kind="three", node_id="n", attempt=2, worker="w")],
                   now=clock.now(conn))
    rows = history.run_history(conn, run_id)
    assert [(r.kind, r.request) for r in rows] == [("one", "req-1"), ("two", "req-1"), ("three", "req-2")]
    assert [r.kind for r in history.of_request(conn, run_id, "req-1")] == ["one", "two"]
    assert history.of_request(conn, run_id, "req-3") == []
    assert rows[1].detail == {"x": 1} and (rows[2].node_id, rows[2].attempt, rows[2].worker) == ("n", 2, "w")
    part = conn.execute("SELECT DISTINCT tableoid::regclass::text FROM run_history WHERE run_id = %s",
                        (run_id,)).fetchall()
    assert part == [(f"run_history_p{month_of(run_id)}",)]       # the run's month


def test_delete_outbox_rows_for_tasks(conn: Any, run_id: str) -> None:
    task_id = _task(conn, run_id)
    outbox.enqueue(conn, [Dispatch(run_id=run_id, task_id=task_id, attempt=0, queue="q", task_name="t",
                                   lease_s=5)], now=clock.now(conn))
    assert outbox.delete_for_tasks(conn, run_id, [task_id]) == 1


def test_webhook_delivery_claim_and_outcomes(conn: Any, run_id: str) -> None:
    _write(conn, run_id, finish=writes.Finish(status="SUCCEEDED", reason=None, output=None,
                                              webhook=("http://127.0.0.1:9/hook", {"run_id": run_id})))
    first = webhooks.claim_due(conn, 10, lease_s=30)
    assert [(d.run_id, d.attempts) for d in first] == [(run_id, 1)]
    assert webhooks.claim_due(conn, 10, lease_s=30) == []         # leased
    webhooks.mark_failed(conn, first[0].run_id, first[0].id, status=500, error="boom", retry_in_s=0)
    again = webhooks.claim_due(conn, 10, lease_s=30)
    assert [d.attempts for d in again] == [2]
    webhooks.mark_delivered(conn, again[0].run_id, again[0].id, 200)
    row = conn.execute("SELECT delivered_at IS NOT NULL, last_status FROM webhook_deliveries").fetchone()
    assert row == (True, 200)
