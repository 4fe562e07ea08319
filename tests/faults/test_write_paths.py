"""Every write path, cut at every request it sends (tests/faults/harness.py).

For each path the operation runs once through the fault proxy per case, and the
engine's own retry (``db_retry``) is what recovers; the check says what the caller
must see and what the database must hold afterwards, which is the same whatever
the fault: exactly the effect of one operation, and the original outcome returned.

The paths are one table, :data:`PATHS`, a row each: its name, how its state is set
up, the operation, and its check. ``test_write_path`` sweeps every row.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from composer_ops.engine import archive
from composer_ops.engine.retention import drop_due_months
from composer_ops.repo import outbox
from composer_ops.testing.faultproxy import Fault
from composer_ops.testing.servers import Server
from tests.chaos.hook import Hook
from tests.faults.cases import (
    CHAIN,
    KEYED,
    KID,
    LIMITED,
    MAP,
    NOWHERE,
    ONE_WAITER,
    PARENT,
    PROMPT,
    RELAY,
    RETRIED,
    TIMER,
    TWO_WAITERS,
    WAITED,
    Rig,
    WritePath,
    _both_waiters_resolved,
    _buffered_once,
    _cancelled_once_each,
    _child_start_row,
    _child_started_once,
    _child_task_claimed,
    _children_delivered,
    _claimed,
    _claimed_by_its_holder,
    _completed_and_handed_out_once,
    _completed_and_next_claimed_once,
    _deleted_once,
    _due_timer,
    _failed_unstarted_once,
    _finished_deliveries,
    _item_completed_once,
    _lease_still_held,
    _leaves,
    _limit_kept,
    _map_item_claimed,
    _months_created,
    _old_deliveries_pruned,
    _one_map_run_started,
    _one_parent_one_child,
    _one_per_key,
    _one_run_started,
    _one_run_started_and_handed_out_once,
    _only_that_month_dropped,
    _parent_and_child_cancelled,
    _parent_completed_by_child,
    _parent_started,
    _posted_once,
    _queue_changed_once,
    _reopened_once,
    _requeued_once,
    _resolved_or_buffered_once,
    _signal_token,
    _succeeded,
    _the_client_run_id_returned,
    _timer_fired,
    _token,
    _two_ready,
    _waited_claimed,
    _waited_start,
    _waiters_and_token,
)
from tests.faults.harness import FULL, bench, sweep
from tests.faults.ops_cases import (
    _a_month_to_drop,
    _archive,
    _archived_and_dropped,
    _archived_once,
    _backfill,
    _backfilled_once,
    _created_once,
    _failed_run,
    _late_start,
    _limited_run,
    _month_2020,
    _months_ahead_missing,
    _paused_once,
    _paused_queue,
    _queue_name,
    _relayed,
    _restored_once,
    _retire,
    _retired_once,
    _schedule,
    _schedule_runs,
    _slots_fired_once,
    _three_tokened_runs,
    _triggered_once,
    _two_of_one_customer,
)
from tests.faults.waiter_cases import (
    _dead_and_live_waiters,
    _dead_forgotten_live_kept,
    _handed_waiter,
    _registered_once,
    _stop_worker,
    _unregistered_task_kept,
    _waiters_pass_again,
)
from tests.integration.helpers import now_utc, uuid7_at

# COMPOSER_FAULTS=full (`make chaos`) cuts every request of every path: bulk cancel alone
# runs past 300 s there, so the full sweep gets an hour per path.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600 if FULL else 300)]

@pytest.fixture(scope="module")
def b(server: Server, template_db: str) -> Iterator[Rig]:
    """One database for the module: every case works on runs of its own (a claim's
    case first cancels what earlier cases left active)."""
    hook = Hook(fail_share=2**40)        # refuses no first POST: one delivery, one POST
    try:
        with server.database(template=template_db) as url, bench(url) as fb:
            rig = Rig(db_url=fb.db_url, proxy=fb.proxy, direct=fb.direct, engine=fb.engine, hook=hook)
            for spec in (CHAIN, RETRIED, TWO_WAITERS, ONE_WAITER, TIMER, LIMITED, PROMPT, KEYED, MAP, KID, PARENT,
                         WAITED):
                rig.direct.deploy(spec)
            for definition, hook_url in (("f-hook", hook.base), ("f-pruned", NOWHERE)):
                rig.direct.deploy({"id": definition, "webhook_url": hook_url, "nodes": ONE_WAITER["nodes"]})
            yield rig
    finally:
        hook.close()


# -- the table ----------------------------------------------------------------------------------

PATHS = [
    # clients
    WritePath("start", lambda b: _token(), lambda b, token: b.engine.start("f-chain", input={"token": token}),
              _one_run_started),
    WritePath("start (client run ID)", lambda b: uuid7_at(now_utc()),
              lambda b, run_id: b.engine.start("f-chain", input={"k": 1}, run_id=run_id),
              _the_client_run_id_returned),
    WritePath("signal (two waiters)", _waiters_and_token, _signal_token, _resolved_or_buffered_once),
    WritePath("start (idle worker registered)", _waited_start,
              lambda b, s: b.engine.start("f-waited", input={"token": s[0]}), _one_run_started_and_handed_out_once),
    WritePath("signal (finishes the run)", lambda b: b.direct.start("f-one-waiter"),
              lambda b, run_id: b.engine.signal(run_id, "go", payload={"x": 1}), _leaves(status="SUCCEEDED")),
    WritePath("signal (buffered)", _both_waiters_resolved, _signal_token, _buffered_once),
    WritePath("cancel", lambda b: b.direct.start("f-chain"),
              lambda b, run_id: b.engine.cancel(run_id, reason="by test"), _leaves(status="CANCELLED")),
    # MAP and SUB_WORKFLOW nodes
    WritePath("start (MAP)", lambda b: _token(),
              lambda b, token: b.engine.start("f-map", input={"token": token, "ids": [1, 2, 3]}),
              _one_map_run_started),
    WritePath("complete (MAP item)", _map_item_claimed, lambda b, s: b.engine.complete(s.claim, "done"),
              _item_completed_once),
    WritePath("start (SUB_WORKFLOW)", lambda b: _token(),
              lambda b, token: b.engine.start("f-parent", input={"token": token}), _one_parent_one_child),
    WritePath("cancel (SUB_WORKFLOW parent)", _parent_started,
              lambda b, run_id: b.engine.cancel(run_id, reason="by test"), _parent_and_child_cancelled),
    WritePath("complete (child's last task)", _child_task_claimed, lambda b, s: b.engine.complete(s.claim, "ok"),
              _parent_completed_by_child),
    # the worker's writes
    WritePath("claim", _two_ready, lambda b, _: b.engine.claim(["fq"], "w-proxied", 1), _claimed_by_its_holder),
    WritePath("claim (limited queue)", _limited_run, lambda b, _: b.engine.claim(["fl"], "w-proxied", 2),
              _limit_kept),
    WritePath("claim (concurrency key)", _two_of_one_customer, lambda b, _: b.engine.claim(["fk"], "w-proxied", 2),
              _one_per_key),
    WritePath("complete", _claimed("f-chain"), lambda b, s: b.engine.complete(s.claim, {"done": True}),
              _leaves(tasks={"a": ("COMPLETED", 0), "b": ("PENDING", 0)}, outbox=[("b", 0)])),
    WritePath("complete (claims the next task)", _claimed("f-chain"),
              lambda b, s: b.engine.complete(s.claim, {"done": True},
                                             claim_next=b.engine.next_claim(["fq"], "w-proxied", 1)),
              _completed_and_next_claimed_once),
    WritePath("complete (idle worker registered)", _waited_claimed,
              lambda b, s: b.engine.complete(s.claim, {"done": True}), _completed_and_handed_out_once),
    WritePath("fail (retried)", _claimed("f-retried"), lambda b, s: b.engine.fail(s.claim, "boom", retryable=True),
              _leaves(tasks={"a": ("PENDING", 1)}, outbox=[("a", 1)])),
    WritePath("fail (for good)", _claimed("f-chain"), lambda b, s: b.engine.fail(s.claim, "fatal", retryable=False),
              _leaves(tasks={"a": ("FAILED", 0)}, status="FAILED")),
    WritePath("heartbeat", _claimed("f-chain"), lambda b, s: b.engine.heartbeat(s.claim), _lease_still_held),
    WritePath("register idle", lambda b: f"w-reg-{_token()[:8]}",
              lambda b, w: b.engine.register_idle(["fw"], w, ["t"], wake=outbox.wake_channel(w), room=2, seen=0),
              _registered_once),
    WritePath("worker stopping (unregister)", _handed_waiter, _stop_worker, _unregistered_task_kept),
    # the coordinator's writes
    WritePath("timer", _due_timer, lambda b, _: b.engine.coordinator().run_once(["timers"]), _timer_fired),
    WritePath("start timeout", _late_start, lambda b, _: b.engine.coordinator().run_once(["timers"]),
              _failed_unstarted_once),
    WritePath("lease sweep", _claimed("f-retried", lease_over=True),
              lambda b, _: b.engine.coordinator().run_once(["leases"]), _requeued_once),
    # under the default policy (one attempt) the expiry must not fail the run
    WritePath("lease expiry (default policy)", _claimed("f-chain", lease_over=True),
              lambda b, _: b.engine.coordinator().run_once(["leases"]), _requeued_once),
    # a pass cut short logs the failure; the next passes (settle) forget what it left
    WritePath("waiters pass (dead workers forgotten)", _dead_and_live_waiters,
              lambda b, _: b.engine.coordinator().run_once(["leases"]), _dead_forgotten_live_kept,
              settle=_waiters_pass_again),
    # a row left by a delivery cut short is delivered again by the next pass (settle)
    WritePath("children pass", _child_start_row, lambda b, _: b.engine.coordinator().run_once(["children"]),
              _child_started_once, settle=_children_delivered),
    WritePath("webhook relay", lambda b: _succeeded(b, "f-hook"),
              lambda b, _: b.engine.coordinator(relay=RELAY).run_once(["webhooks"]), _posted_once, settle=_relayed),
    WritePath("webhook prune", _finished_deliveries,
              lambda b, _: b.engine.coordinator(webhook_keep_days=7).run_once(["webhooks"]), _old_deliveries_pruned),
    WritePath("partition upkeep", _months_ahead_missing,
              lambda b, _: b.engine.coordinator(months_ahead=5).run_once(["partitions"]), _months_created),
    WritePath("schedules pass", partial(_schedule, due_hours=2),
              lambda b, _: b.engine.coordinator().run_once(["schedules"]), _slots_fired_once),
    WritePath("retention drop", _a_month_to_drop,
              lambda b, _: drop_due_months(b.proxy.url(), datetime(2021, 1, 1, tzinfo=UTC)), _only_that_month_dropped),
    # operators
    WritePath("delete run", lambda b: _succeeded(b, "f-one-waiter"), lambda b, run_id: b.engine.delete_run(run_id),
              _deleted_once),
    WritePath("retry run", _failed_run, lambda b, run_id: b.engine.retry(run_id), _reopened_once),
    WritePath("bulk cancel", _three_tokened_runs,
              lambda b, s: b.engine.cancel_runs(where={"token": s[0]}, yes=True, chunk=2), _cancelled_once_each),
    WritePath("schedules create", lambda b: f"c-{_token()[:12]}",
              lambda b, name: b.engine.schedules.create(name, workflow="f-chain", cron="0 2 * * *",
                                                        timezone="UTC"), _created_once),
    WritePath("schedules pause", _schedule, lambda b, name: b.engine.schedules.pause(name), _paused_once),
    WritePath("schedules trigger", _schedule, lambda b, name: b.engine.schedules.trigger(name), _triggered_once),
    WritePath("schedules backfill", _schedule, _backfill, _backfilled_once),
    WritePath("queues pause", _queue_name, lambda b, q: b.engine.queues.pause(q, reason="incident"),
              _queue_changed_once("queues pause", (True, 0))),
    WritePath("queues resume", _paused_queue, lambda b, q: b.engine.queues.resume(q),
              _queue_changed_once("queues resume", (False, 0))),
    WritePath("queues set-limit", _queue_name, lambda b, q: b.engine.queues.set_limit(q, 3),
              _queue_changed_once("queues set-limit", (False, 3))),
    WritePath("partitions archive", _month_2020, lambda b, m: _archive(b.proxy.url(), m), _archived_once,
              every_request=False),
    WritePath("partitions drop --archive", _month_2020, lambda b, m: _retire(b.proxy.url(), m),
              _retired_once("dropped", "partitions drop"), every_request=False),
    WritePath("partitions detach", _month_2020, lambda b, m: _retire(b.proxy.url(), m, keep_table=True),
              _retired_once("detached", "partitions detach"), every_request=False),
    WritePath("partitions restore", _archived_and_dropped,
              lambda b, m: archive.restore_month(b.proxy.url(), "202001", Path(m.directory), yes=True),
              _restored_once, every_request=False),
]


@pytest.mark.parametrize("path", PATHS, ids=[p.id for p in PATHS])
def test_write_path(b: Rig, path: WritePath) -> None:
    sweep(b, path.name, setup=partial(path.setup, b), act=partial(path.act, b), check=partial(path.check, b),
          every_request=path.every_request,
          settle=partial(path.settle, b) if path.settle is not None else None).assert_clean()


def test_schedules_pass_retry_waits_for_its_lost_attempts_lock(b: Rig) -> None:
    """A pass whose connection is cut mid-transaction is retried at once; the server may
    not yet have ended the cut session, which still holds the schedule's row lock (a
    loaded machine: the sweep's one failure, 'runs [] for 3 slots' with the cursor where
    it was). The retry must wait for that lock, not skip the schedule as if another
    coordinator were deciding it, nor leave it to a later pass that the lock may skip too.
    The cut session is stopped (SIGSTOP) until a second after the cut to make it so."""
    name = _schedule(b, due_hours=2)
    with b.engine.pool.connection() as conn:
        pid = conn.info.backend_pid
    fire = b.proxy._fire
    timers: list[threading.Timer] = []

    def stop_then_fire(pipe: Any, req: Any) -> None:
        os.kill(pid, signal.SIGSTOP)       # the session cannot see its client go
        timer = threading.Timer(1.5, os.kill, (pid, signal.SIGCONT))
        timers.append(timer)
        timer.start()
        fire(pipe, req)

    applies = iter(range(1, 100))
    b.proxy._fire = stop_then_fire  # type: ignore[method-assign]
    try:
        b.proxy.reset()
        b.proxy.arm(Fault.LOSE_ACK, match=lambda r: "composer_event" in r.text and next(applies) == 2)
        stats = b.engine.coordinator().run_once(["schedules"])
        fired = b.proxy.fired
        b.proxy.disarm()
        sid, cursor = b.sql("SELECT id, next_slot_at FROM schedules WHERE name = %s", (name,))[0]
        fired_runs = _schedule_runs(b, name)
    finally:
        b.proxy._fire = fire  # type: ignore[method-assign]
        for timer in timers:
            timer.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)    # the session ended once it was let run
    assert fired is not None and "composer_event" in fired.text
    assert stats.schedule_runs_started == 3 and not stats.errors, stats
    assert len(fired_runs) == 3 and all(datetime.fromisoformat(s) < cursor for _, _, s in fired_runs), \
        (fired_runs, cursor)
    assert b.sql("SELECT count(*) FROM schedule_events WHERE schedule_id = %s AND kind = 'started'", (sid,)) == [(3,)]

