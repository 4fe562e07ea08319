"""Queue levers (engine/queues.py, repo/queues.py, the claim of sql/R__claim.sql): a
paused queue gives no task and keeps them, resume gives them again; max_running bounds
the RUNNING attempts of a queue and frees a place when an attempt ends; priorities order
the claim within a queue; each change is audited, a dry run changes nothing, and a
change retried with its request ID is not applied twice."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.errors import Invalid
from composer_ops.testing.processes import wait_for


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=4) as e:
        for name, priority in (("low", 0), ("high", 5), ("mid", 2)):
            e.deploy({"id": name, "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "q",
                                             **({"priority": priority} if priority else {})}]})
        e.deploy({"id": "other", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "r"}]})
        yield e


def _sql(url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(query, params).fetchall()


def test_a_paused_queue_claims_nothing_keeps_its_tasks_and_resumes(db_url: str, engine: Engine) -> None:
    runs = [engine.start("low") for _ in range(3)]
    other = engine.start("other")
    dry = engine.queues.pause("q", reason="provider down", yes=False)
    assert (dry.applied, dry.changed, dry.after["paused"]) == (False, True, True)
    assert _sql(db_url, "SELECT count(*) FROM queue_settings") == [(0,)]
    paused = engine.queues.pause("q", reason="provider down")
    assert (paused.applied, paused.changed) == (True, True)
    assert engine.claim(["q"], "w1", 10) == []
    taken = engine.claim(["q", "r"], "w1", 10)
    assert [c.run_id for c in taken] == [other]                  # the other queue is not held up
    listed = {r.queue: r for r in engine.queues.list()}
    assert listed["q"].paused and listed["q"].reason == "provider down" and listed["q"].depth == 3
    assert listed["q"].paused_s is not None and listed["q"].paused_s >= 0
    assert not listed["r"].paused and listed["r"].running == 1
    again = engine.queues.pause("q")      # paused again without a reason: the first one's stays
    assert (again.changed, again.after["reason"]) == (False, "provider down")
    assert {r.queue: r for r in engine.queues.list()}["q"].reason == "provider down"
    engine.queues.resume("q")
    assert sorted(c.run_id for c in engine.claim(["q"], "w1", 10)) == sorted(runs)
    actions = _sql(db_url, "SELECT action, target, counts FROM operator_audit ORDER BY id")
    assert actions == [("queues pause", "q", {"changed": 1}), ("queues pause", "q", {"changed": 0}),
                       ("queues resume", "q", {"changed": 1})]


def test_max_running_bounds_the_queue_and_frees_a_place_when_an_attempt_ends(db_url: str,
                                                                            engine: Engine) -> None:
    for _ in range(5):
        engine.start("low")
    engine.queues.set_limit("q", 2)
    first = engine.claim(["q"], "w1", 10)
    assert len(first) == 2
    assert engine.claim(["q"], "w2", 10) == []
    assert _sql(db_url, "SELECT count(*) FROM flow_slots") == [(2,)]
    engine.complete(first[0], {"ok": True})                    # the trigger frees its place
    assert _sql(db_url, "SELECT count(*) FROM flow_slots") == [(1,)]
    second = engine.claim(["q"], "w2", 10)
    assert len(second) == 1
    engine.fail(first[1], "boom", retryable=False)
    assert len(engine.claim(["q"], "w2", 10)) == 1
    engine.queues.set_limit("q", 0)                            # no limit: the rest at once
    assert len(engine.claim(["q"], "w3", 10)) == 1
    running = _sql(db_url, "SELECT count(*) FROM task_instances WHERE state = 'RUNNING'")
    assert running == [(3,)]


def test_priority_orders_the_claim_within_a_queue(engine: Engine) -> None:
    low = engine.start("low")
    high = engine.start("high")
    mid = engine.start("mid")
    assert [engine.claim(["q"], "w", 1)[0].run_id for _ in range(3)] == [high, mid, low]


def test_a_claim_of_several_queues_takes_their_rows_in_one_order(db_url: str, engine: Engine) -> None:
    """The pick walks each queue in its index's order and merges the walks: priority
    first, then the time a row is available from (not its ID), across the queues."""
    first = engine.start("low")
    other = engine.start("other")
    second = engine.start("low")
    high = engine.start("high")
    later = engine.start("other")
    mid = engine.start("mid")
    retried = engine.start("low")
    _sql(db_url, "UPDATE task_outbox SET available_at = available_at - interval '1 hour' WHERE run_id = %s "
                 "RETURNING id", (retried,))                 # available before all, the newest ID
    taken = [engine.claim(["r", "q"], "w", 1)[0].run_id for _ in range(7)]
    assert taken == [high, mid, retried, first, other, second, later]
    assert engine.claim(["q", "r", "q"], "w", 1) == []


def test_a_pick_in_any_session_follows_the_index_whatever_its_cached_plans(db_url: str) -> None:
    """composer_pick turns off the scans that cannot follow the index's order: called in
    a session of default settings whose plans were made while the outbox was empty, it
    reads a handful of rows behind 1,500, not all of them."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ANALYZE task_outbox")
        for _ in range(8):                 # past the plan cache's five custom plans
            assert conn.execute("SELECT * FROM composer_pick(ARRAY['q'], NULL, 1)").fetchall() == []
        conn.execute("""INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at)
                        SELECT 'q', 'backlog-' || i, 't', 1, 'work', 30, now() FROM generate_series(1, 1500) AS i""")
        with conn.transaction():
            before = conn.execute("SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_xact_user_tables"
                                  " WHERE relname = 'task_outbox'").fetchone()
            assert len(conn.execute("SELECT * FROM composer_pick(ARRAY['q'], NULL, 1)").fetchall()) == 1
            after = conn.execute("SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_xact_user_tables"
                                 " WHERE relname = 'task_outbox'").fetchone()
    assert before is not None and after is not None
    assert after[0] - before[0] < 20, f"a pick of one read {after[0] - before[0]} outbox rows"


def test_a_null_among_the_ids_a_pick_skips_skips_nothing_else(db_url: str, engine: Engine) -> None:
    """``o.id <> ALL(p_skip)`` is NULL for every row when p_skip holds a NULL: the pick
    took nothing. A NULL names no row; the rows not named are taken."""
    for _ in range(3):
        engine.start("low")
    ids = [row[0] for row in _sql(db_url, "SELECT id FROM task_outbox ORDER BY id")]
    got = _sql(db_url, "SELECT * FROM composer_pick(ARRAY['q'], NULL, 5, ARRAY[NULL, %s]::bigint[])", (ids[0],))
    assert [row[0] for row in got] == ids[1:]


def test_a_claim_reads_the_rows_it_takes_not_the_whole_backlog(db_url: str, engine: Engine) -> None:
    """Behind 1,500 ready rows a one-task claim reads a handful of outbox rows: the pick
    follows the index's order instead of reading and sorting every ready row."""
    runs = {engine.start("low") for _ in range(8)}
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("""INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at)
                        SELECT 'q', 'backlog-' || i, 't', 1, 'work', 30, now()
                          FROM generate_series(1, 1500) AS i""")       # ready, behind the runs
        conn.execute("ANALYZE task_outbox")
        for i in range(8):                 # past the plan cache's five custom plans
            with conn.transaction():
                if i == 7:
                    before = conn.execute(
                        "SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_xact_user_tables"
                        " WHERE relname = 'task_outbox'").fetchone()
                got = conn.execute("SELECT run_id FROM composer_claim(ARRAY['q'], NULL, 'w', 1, %s, NULL)",
                                   (f"claim-{i}",)).fetchall()
                assert len(got) == 1 and got[0][0] in runs
                if i == 7:
                    after = conn.execute(
                        "SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_xact_user_tables"
                        " WHERE relname = 'task_outbox'").fetchone()
        assert before is not None and after is not None
        assert after[0] - before[0] < 20, f"a one-task claim read {after[0] - before[0]} outbox rows"


def test_a_change_retried_with_its_request_is_applied_once(db_url: str, engine: Engine) -> None:
    first = engine.queues.set_limit("q", 3, request_id="req-1")
    engine.queues.set_limit("q", 7)                             # someone else changes it meanwhile
    again = engine.queues.set_limit("q", 3, request_id="req-1")
    assert again.duplicate and again.after == first.after
    assert _sql(db_url, "SELECT max_running FROM queue_settings") == [(7,)]
    assert _sql(db_url, "SELECT count(*) FROM operator_audit WHERE request = 'req-1'") == [(1,)]


def done_request(url: str) -> str:
    """The request of the newest audit row: what a retry after a lost acknowledgement repeats."""
    return str(_sql(url, "SELECT request FROM operator_audit ORDER BY id DESC LIMIT 1")[0][0])


def test_a_change_to_nothing_leaves_no_row_for_a_queue_that_had_none(db_url: str, engine: Engine) -> None:
    """`queues resume nosuchqueue --yes` (a typo) made a settings row, and the typo stayed
    in `queues list` for good. A change that changes nothing writes no row; its audit
    row still records it."""
    done = engine.queues.resume("nosuchqueue")
    assert done.applied and not done.changed
    assert _sql(db_url, "SELECT count(*) FROM queue_settings WHERE queue = 'nosuchqueue'") == [(0,)]
    assert _sql(db_url, "SELECT count(*) FROM operator_audit WHERE target = 'nosuchqueue'") == [(1,)]
    again = engine.queues.resume("nosuchqueue", request_id=done_request(db_url))   # retried after a lost ack
    assert again.duplicate
    assert _sql(db_url, "SELECT count(*) FROM queue_settings WHERE queue = 'nosuchqueue'") == [(0,)]
    engine.queues.set_limit("q", 2)
    engine.queues.set_limit("q", 0)           # a row that existed stays, at its defaults
    assert _sql(db_url, "SELECT max_running FROM queue_settings WHERE queue = 'q'") == [(0,)]


def test_pausing_again_keeps_the_first_instant(db_url: str, engine: Engine) -> None:
    engine.queues.pause("q", reason="one")
    at = _sql(db_url, "SELECT paused_at FROM queue_settings")
    again = engine.queues.pause("q", reason="two")
    assert again.changed and _sql(db_url, "SELECT paused_at, reason FROM queue_settings") == [(at[0][0], "two")]


@pytest.mark.parametrize(("call", "message"), [
    (lambda e: e.queues.pause("bad name"), "queue 'bad name' is not a queue name"),
    (lambda e: e.queues.set_limit("q", -1), "--max-running must be an integer from 0"),
    (lambda e: e.queues.set_limit("q", True), "--max-running must be an integer from 0"),
    (lambda e: e.queues.pause("q", reason="x" * 1001), "the reason must be text"),
])
def test_bad_input_is_refused_and_changes_nothing(db_url: str, engine: Engine, call: Any, message: str) -> None:
    with pytest.raises(Invalid, match=message):
        call(engine)
    assert _sql(db_url, "SELECT count(*) FROM queue_settings") == [(0,)]


def test_cli(db_url: str, engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    engine.start("low")
    url = ["--database-url", db_url]
    assert main(["queues", "pause", "q", "--reason", "incident 42", *url]) == 0
    captured = capsys.readouterr()
    assert "dry run" in captured.out and "warning" not in captured.err          # its workflows name q
    assert _sql(db_url, "SELECT count(*) FROM queue_settings") == [(0,)]
    # A queue nothing names: a typo, said; the change goes on (a queue may be set up first).
    assert main(["queues", "pause", "qq", *url]) == 0
    assert "composer-ops: warning: no deployed workflow, worker, task or setting names queue 'qq'" in \
        capsys.readouterr().err
    engine.deploy({"id": "plain", "nodes": [{"id": "t", "type": "TASK", "task": "work"}]})
    assert main(["queues", "resume", "default", *url]) == 0
    assert "warning" not in capsys.readouterr().err           # a TASK without a queue names it
    assert main(["queues", "pause", "q", "--reason", "incident 42", "--yes", "--json", *url]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["applied"] and done["after"] == {"paused": True, "reason": "incident 42", "max_running": 0}
    assert main(["queues", "set-limit", "q", "--max-running", "4", "--yes", *url]) == 0
    assert "max running 4" in capsys.readouterr().out
    assert main(["queues", "list", "--json", *url]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["queue"], row["paused"], row["max_running"], row["depth"]) == ("q", True, 4, 1)
    assert main(["queues", "list", *url]) == 0
    assert "incident 42" in capsys.readouterr().out
    assert main(["queues", "resume", "q", "--yes", *url]) == 0
    assert "open" in capsys.readouterr().out
    assert main(["queues", "set-limit", "q", "--max-running", "-2", "--yes", *url]) == 2
    assert "--max-running must be an integer" in capsys.readouterr().err
    assert main(["queues", "pause", "no way", "--yes", *url]) == 2
    command = _sql(db_url, "SELECT command FROM operator_audit ORDER BY id LIMIT 1")[0][0]
    assert command.startswith("composer-ops queues pause q --reason")


def test_the_lease_sweeper_frees_a_place_the_trigger_missed(db_url: str, engine: Engine) -> None:
    engine.start("low")
    engine.start("low")
    engine.queues.set_limit("q", 1)
    (held,) = engine.claim(["q"], "w1", 10)
    with psycopg.connect(db_url) as conn:                      # an edit by hand that bypasses the trigger
        conn.execute("UPDATE task_instances SET flow_slot = NULL WHERE id = %s", (held.task_id,))
    engine.complete(held, None)
    assert engine.claim(["q"], "w2", 10) == []                 # the place is still taken
    stats = engine.coordinator().run_once(["leases"])
    assert stats.slots_freed == 1
    assert len(engine.claim(["q"], "w2", 10)) == 1


def test_check_alerts_on_a_long_pause_and_exports_the_queues(db_url: str, engine: Engine, tmp_path: Any) -> None:
    from composer_ops.ops.health import Thresholds, check_health, write_prometheus

    engine.start("low")
    engine.start("low")
    engine.queues.set_limit("q", 1)
    engine.claim(["q"], "w", 10)
    engine.queues.pause("q", reason="incident")
    calm = check_health(db_url)
    assert next(c for c in calm.checks if c.name == "queue paused long").alert is False
    health = check_health(db_url, Thresholds(queue_paused_h=0, outbox_ready_age_s=0))
    paused = next(c for c in health.checks if c.name == "queue paused long")
    assert paused.alert and paused.value > 0 and "queue(s) q paused" in paused.detail
    # Its ready row waits on purpose: not the outbox check's (which would send the
    # operator to start workers), whatever its age.
    outbox = next(c for c in health.checks if c.name == "oldest ready outbox row")
    assert not outbox.alert and outbox.value == 0, outbox
    assert "not counted: 1 ready in queue(s) q, paused or at their limit" in outbox.detail
    engine.start("other")                   # queue r, open: counted
    other = next(c for c in check_health(db_url, Thresholds(outbox_ready_age_s=0)).checks
                 if c.name == "oldest ready outbox row")
    assert other.alert and "no worker claims queue(s) r" in other.detail, other
    row = next(r for r in health.queues if r["queue"] == "q")
    assert (row["queue"], row["paused"], row["max_running"], row["running"], row["depth"], row["at_limit"]) == \
        ("q", True, 1, 1, 1, True)
    prom = tmp_path / "composer.prom"
    write_prometheus(health, str(prom))
    text = prom.read_text()
    for line in ('composer_queue_paused{queue="q"} 1.0', 'composer_queue_depth{queue="q"} 1.0',
                 'composer_queue_at_limit{queue="q"} 1.0', 'composer_queue_running{queue="q"} 1.0'):
        assert line in text


def test_start_to_close_caps_the_lease_and_its_heartbeats_then_fails_the_attempt_per_its_retry_policy(
        db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "slow", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "s", "lease_s": 60,
                                            "retry": {"max_attempts": 2, "initial_backoff_s": 0},
                                            "timeouts": {"start_to_close_s": 5}}]})
    run_id = engine.start("slow")
    (claim,) = engine.claim(["s"], "w", 1)
    assert claim.lease_s == 5
    held = _sql(db_url, "SELECT extract(epoch FROM lease_expires_at - started_at)::int, "
                        "extract(epoch FROM run_deadline_at - started_at)::int FROM task_instances WHERE id = %s",
                (claim.task_id,))
    assert held == [(5, 5)]
    # Time passes (the stored instants move back, the database clock is not ours): a heartbeat
    # 4 s in may not extend the lease past the deadline, 1 s away.
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_instances SET run_deadline_at = now() + interval '1 second', "
                     "lease_expires_at = now() + interval '1 second' WHERE id = %s", (claim.task_id,))
    extended = engine.heartbeat(claim)
    deadline = _sql(db_url, "SELECT run_deadline_at FROM task_instances WHERE id = %s", (claim.task_id,))[0][0]
    assert extended == deadline
    with psycopg.connect(db_url) as conn:               # the deadline passes, the handler still running
        conn.execute("UPDATE task_instances SET run_deadline_at = now() - interval '1 millisecond', "
                     "lease_expires_at = now() - interval '1 millisecond' WHERE id = %s", (claim.task_id,))
    assert engine.heartbeat(claim) is None
    engine.coordinator().run_once(["leases"])
    task = engine.get_run(run_id).tasks[0]
    assert (task.state, task.attempt) in {("PENDING", 1), ("QUEUED", 1)}
    assert "start_to_close timeout" in str(task.error)
    (again,) = engine.claim(["s"], "w", 1)                # the second and last attempt also runs too long
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_instances SET run_deadline_at = now() - interval '1 millisecond', "
                     "lease_expires_at = now() - interval '1 millisecond' WHERE id = %s", (again.task_id,))
    engine.coordinator().run_once(["leases"])
    run = engine.get_run(run_id)
    assert run.status == "FAILED" and "failed after 2 attempts: start_to_close timeout" in str(run.error)
    # Each is the handler's failure in the run's history too (before: "lease_expired", so
    # `runs show` said "lease expired" of an attempt the retry policy counted as failed).
    kinds = _sql(db_url, "SELECT kind, attempt, detail->>'error' FROM run_history WHERE run_id = %s "
                         "AND kind IN ('failed', 'lease_expired') ORDER BY attempt", (run_id,))
    assert [(k, a) for k, a, _ in kinds] == [("failed", 0), ("failed", 1)], kinds
    assert all(e.startswith("start_to_close timeout: attempt ") for _, _, e in kinds), kinds


def test_without_start_to_close_a_lapsed_lease_is_a_lease_expiry(db_url: str, engine: Engine) -> None:
    run_id = engine.start("low")
    (claim,) = engine.claim(["q"], "w", 1)
    assert _sql(db_url, "SELECT run_deadline_at FROM task_instances WHERE id = %s", (claim.task_id,)) == [(None,)]
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_instances SET lease_expires_at = now() - interval '1 millisecond' WHERE id = %s",
                     (claim.task_id,))
    engine.coordinator().run_once(["leases"])
    assert _sql(db_url, "SELECT lease_expiries, attempt FROM task_instances WHERE run_id = %s", (run_id,)) == [(1, 1)]


def test_a_low_priority_waiting_past_the_aging_time_is_claimed_before_newer_high_ones(db_url: str,
                                                                                     engine: Engine) -> None:
    low = engine.start("low")
    highs = [engine.start("high") for _ in range(2)]
    with psycopg.connect(db_url) as conn:       # low has been ready for 61 s (the instant moves, not the clock)
        conn.execute("UPDATE task_outbox SET available_at = now() - interval '61 seconds' WHERE run_id = %s", (low,))
    assert engine.coordinator(priority_aging_s=120).run_once(["timers"]).priorities_raised == 0
    assert engine.coordinator(priority_aging_s=60).run_once(["timers"]).priorities_raised == 1
    assert _sql(db_url, "SELECT priority FROM task_outbox WHERE run_id = %s", (low,)) == [(5,)]
    assert [engine.claim(["q"], "w", 1)[0].run_id for _ in range(3)] == [low, *highs]


def _late(db_url: str, run_id: str) -> None:
    """The dispatch's schedule_to_start deadline has passed (the instant moves, not the clock)."""
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE task_outbox SET start_by = now() - interval '1 millisecond' WHERE run_id = %s", (run_id,))


def test_a_task_not_claimed_by_its_schedule_to_start_deadline_fails_its_run(db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "prompt", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "p",
                                              "retry": {"max_attempts": 3},
                                              "timeouts": {"schedule_to_start_s": 30}}]})
    run_id = engine.start("prompt")
    started_by = _sql(db_url, "SELECT extract(epoch FROM start_by - available_at)::int FROM task_outbox")
    assert started_by == [(30,)]
    assert engine.coordinator().run_once(["timers"]).start_timeouts == 0       # not yet due
    _late(db_url, run_id)
    assert engine.coordinator().run_once(["timers"]).start_timeouts == 1
    run = engine.get_run(run_id)
    assert run.status == "FAILED" and "schedule_to_start timeout: attempt 0 not claimed within 30 s" in str(run.error)
    assert _sql(db_url, "SELECT count(*) FROM task_outbox") == [(0,)]
    assert engine.claim(["p"], "w", 1) == []


def test_a_claim_racing_the_start_timeout_wins_when_it_commits_first(db_url: str, engine: Engine) -> None:
    from composer_ops.db import connect
    from composer_ops.repo import outbox

    engine.deploy({"id": "prompt", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "p",
                                              "timeouts": {"schedule_to_start_s": 30}}]})
    run_id = engine.start("prompt")
    _late(db_url, run_id)
    outcome: list[Any] = []
    with connect(db_url) as claimer:
        with claimer.transaction():
            (claimed,) = outbox.claim(claimer, ["p"], "w", 1, claim_id="race")    # holds the dispatch's row
            coordinator = engine.coordinator()
            racer = threading.Thread(target=lambda: outcome.append(coordinator.run_once(["timers"])))
            racer.start()
            wait_for(lambda: _sql(db_url, "SELECT count(*) FROM pg_locks WHERE NOT granted")[0][0] > 0,
                     what="the timeout's DELETE to wait for the claim's row lock")
        racer.join(60)
    assert outcome and outcome[0].start_timeouts == 0 and outcome[0].stale == 1
    task = engine.get_run(run_id).tasks[0]
    assert (task.state, engine.get_run(run_id).status) == ("RUNNING", "RUNNING")
    engine.complete(claimed, {"ok": True})
    assert engine.get_run(run_id).status == "SUCCEEDED"


def test_a_concurrency_key_at_its_limit_does_not_hold_up_other_keys(db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "percust", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "k",
                                               "concurrency": {"key": "$.input.customer", "limit": 1}}]})
    first = [engine.start("percust", input={"customer": "A"}) for _ in range(3)]
    b = engine.start("percust", input={"customer": "B"})
    seven = engine.start("percust", input={"customer": 7})
    taken = engine.claim(["k"], "w", 10)
    assert sorted(c.run_id for c in taken) == sorted([first[0], b, seven])   # A's others wait; B and 7 do not
    assert engine.claim(["k"], "w", 10) == []
    assert _sql(db_url, "SELECT key, count(*) FROM flow_slots GROUP BY key ORDER BY key") == [
        ("c:7", 1), ("c:A", 1), ("c:B", 1)]
    engine.complete(next(c for c in taken if c.run_id == first[0]), None)
    (second,) = engine.claim(["k"], "w", 10)
    assert second.run_id == first[1]


def test_a_rate_limit_gives_its_burst_then_refills_by_the_database_clock(db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "metered", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "r2",
                                               "rate_limit": {"key": "api", "per_s": 1, "burst": 2}}]})
    for _ in range(5):
        engine.start("metered")
    assert len(engine.claim(["r2"], "w", 10)) == 2              # the burst
    assert engine.claim(["r2"], "w", 10) == []
    with psycopg.connect(db_url) as conn:                       # 1.5 s pass for the bucket
        conn.execute("UPDATE rate_buckets SET updated_at = updated_at - interval '1.5 seconds'")
    assert len(engine.claim(["r2"], "w", 10)) == 1
    tokens = _sql(db_url, "SELECT tokens FROM rate_buckets WHERE key = 'api'")[0][0]
    assert 0 <= tokens < 1


def test_keys_at_their_limit_and_rate_limited_waits_are_reported(db_url: str, engine: Engine, tmp_path: Any) -> None:
    from composer_ops import ops
    from composer_ops.ops.health import check_health, write_prometheus

    engine.deploy({"id": "percust", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "k",
                                               "concurrency": {"key": "$.input.customer", "limit": 1}}]})
    engine.deploy({"id": "metered", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "r2",
                                               "rate_limit": {"key": "api", "per_s": 0.01, "burst": 1}}]})
    for _ in range(3):
        engine.start("percust", input={"customer": "A"})
        engine.start("metered")
    engine.start("percust", input={"customer": "B"})
    assert len(engine.claim(["k", "r2"], "w", 10)) == 3        # A's first, B's, one token of api
    full = ops.keys_at_limit(db_url)
    assert full.select("queue", "key", "key_limit", "running", "waiting").rows() == [("k", "A", 1, 1, 2)]
    waits = ops.rate_limited(db_url)
    assert waits.select("key", "waiting").rows() == [("api", 2)] and waits["tokens"][0] < 1
    health = check_health(db_url)
    assert health.keys_at_limit == 1
    prom = tmp_path / "composer.prom"
    write_prometheus(health, str(prom))
    assert "composer_concurrency_keys_at_limit 1.0" in prom.read_text()


def test_schedule_to_start_latency_per_queue(db_url: str, engine: Engine) -> None:
    from composer_ops import ops

    waited = {engine.start("low"): 10, engine.start("low"): 2}
    with psycopg.connect(db_url) as conn:             # they were created that many seconds before the claim
        for run_id, seconds in waited.items():
            conn.execute("UPDATE task_instances SET created_at = now() - make_interval(secs => %s) "
                         "WHERE run_id = %s", (seconds, run_id))
    assert len(engine.claim(["q"], "w", 10)) == 2
    (row,) = ops.start_latency(db_url).rows(named=True)
    assert (row["queue"], row["claims"]) == ("q", 2)
    assert row["p50_s"] == pytest.approx(6, abs=1.5) and row["p95_s"] == pytest.approx(9.6, abs=1.5)


def test_a_claim_takes_tokens_and_key_locks_only_for_the_rows_it_takes(db_url: str, engine: Engine) -> None:
    """With many keyed dispatches ready, a claim of one task takes one token and holds one
    key: a racing claim in another transaction takes a task of another key meanwhile (a
    pick that asked flow control about every ready row before sorting them took a
    token and a key's lock for each)."""
    from composer_ops.db import connect
    from composer_ops.repo import outbox

    engine.deploy({"id": "metered_many", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "m",
                                                    "rate_limit": {"key": "api", "per_s": 0.001, "burst": 1000}}]})
    engine.deploy({"id": "keyed_many", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "c",
                                                  "concurrency": {"key": "$.input.customer", "limit": 1}}]})
    for _ in range(40):
        engine.start("metered_many")
    for customer in range(20):
        engine.start("keyed_many", input={"customer": customer})
    assert len(engine.claim(["m"], "w", 1)) == 1
    (tokens,) = _sql(db_url, "SELECT tokens FROM rate_buckets WHERE key = 'api'")[0]
    assert 998.5 < tokens <= 999.01                         # one token, whatever the refill since
    with connect(db_url) as first, connect(db_url) as second:
        with first.transaction():
            (held,) = outbox.claim(first, ["c"], "w1", 1, claim_id="first")
            with second.transaction():                      # while the first holds what it took
                (other,) = outbox.claim(second, ["c"], "w2", 1, claim_id="second")
    assert held.run_id != other.run_id
    assert _sql(db_url, "SELECT count(*) FROM flow_slots WHERE key LIKE 'c:%'")[0][0] == 2


def _ready(conn: psycopg.Connection[Any], rows: list[tuple[str, int]]) -> list[int]:
    """Ready outbox rows of queue 'q', one per (run, priority), in that order of age."""
    ids = []
    for k, (run, priority) in enumerate(rows):
        row = conn.execute("""INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s,
                                                       available_at, priority)
                              VALUES ('q', %s, %s, 1, 'work', 30, now() - make_interval(secs => 100 - %s), %s)
                              RETURNING id""", (run, f"t{k}", k, priority)).fetchone()
        assert row is not None
        ids.append(row[0])
    return ids


def _pick(conn: psycopg.Connection[Any], limit: int, busy: list[str] | None = None) -> list[int]:
    # Rolled back: the rows stay ready, unlocked, for the next pick.
    conn.execute("BEGIN")
    try:
        got = conn.execute("SELECT * FROM composer_pick(ARRAY['q'], NULL, %s, NULL, %s::text[])",
                           (limit, busy)).fetchall()
    finally:
        conn.execute("ROLLBACK")
    return [r[0] for r in got]


def test_a_pick_spreads_over_runs_within_a_priority(db_url: str) -> None:
    """The rows of a run the worker is busy with, or that the pick already took a row of,
    come after other runs' of the same priority; never before a higher priority's, and
    taken all the same when nothing else is ready (sql/R__claim.sql, spread over runs)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        a1, a2, b1, a3 = _ready(conn, [("A", 0), ("A", 0), ("B", 0), ("A", 0)])
        assert _pick(conn, 2) == [a1, b1]                       # one of each run first
        assert _pick(conn, 4) == [a1, b1, a2, a3]               # then the rest, in order
        assert _pick(conn, 1, ["A"]) == [b1]                    # A busy: B's first
        assert _pick(conn, 3, ["A", "B"]) == [a1, a2, b1]       # all busy: in order
        conn.execute("DELETE FROM task_outbox")
        hi, lo = _ready(conn, [("A", 5), ("B", 0)])
        assert _pick(conn, 1, ["A"]) == [hi]                    # a higher priority goes first
        conn.execute("DELETE FROM task_outbox")
        # At most 64 rows put back: a row far behind a busy run's is not reached.
        ids = _ready(conn, [("A", 0)] * 70 + [("B", 0)])
        assert _pick(conn, 1, ["A"]) == [ids[0]]


def test_a_worker_busy_with_a_run_claims_another_runs_task_first(engine: Engine) -> None:
    first, second = engine.start("low"), engine.start("low")
    assert [c.run_id for c in engine.claim(["q"], "w", 1, busy=[first])] == [second]
    assert [c.run_id for c in engine.claim(["q"], "w", 1, busy=[first])] == [first]


@pytest.mark.parametrize("limit_by", ["key", "queue"])
def test_a_freed_place_is_taken_at_once_not_at_the_next_poll(db_url: str, engine: Engine, limit_by: str) -> None:
    """A task that frees a flow place (its key's or its queue's) wakes a worker for the
    tasks waiting behind it: six tasks of 50 ms in one place take about 0.3 s, where
    waiting for the worker's poll (30 s here) would take minutes."""
    from composer_ops import TaskContext, Worker

    node: dict[str, Any] = {"id": "t", "type": "TASK", "task": "brief", "queue": "flow"}
    if limit_by == "key":
        node.update(concurrency={"key": "$.input.customer", "limit": 1}, input={"customer": "$.input.customer"})
    else:
        engine.queues.set_limit("flow", 1)
    engine.deploy({"id": "brief", "nodes": [node]})
    runs = [engine.start("brief", input={"customer": "c1"}) for _ in range(6)]
    worker = Worker(engine, queues=["flow"], concurrency=2, poll_interval=30)
    # Another worker on the queue, without the task's handler: never the one told.
    bystander = Worker(engine, queues=["flow"], concurrency=2, poll_interval=30)

    @worker.handler("brief")
    def brief(input: Any, ctx: TaskContext) -> None:
        time.sleep(0.05)

    @bystander.handler("other")
    def other(input: Any, ctx: TaskContext) -> None:
        return None

    threads = [threading.Thread(target=w.run, daemon=True) for w in (worker, bystander)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: all(engine.get_run(r).status == "SUCCEEDED" for r in runs), timeout=25,
                 what="every run, each claimed when the place before it freed")
    finally:
        for w, thread in zip((worker, bystander), threads, strict=True):
            w.stop()
            thread.join(60)
    assert time.monotonic() - began < 25
    spans = _sql(db_url, "SELECT started_at, finished_at FROM task_instances WHERE queue = 'flow' ORDER BY 1")
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:], strict=False)), spans  # one place


def test_a_queue_named_twice_in_a_claim_is_counted_once(db_url: str, engine: Engine) -> None:
    """Twice in the claim's queues, a limited queue was counted and picked twice, each time
    up to its whole room: a claim of ["q", "q"] took twice its limit."""
    for _ in range(5):
        engine.start("low")
    engine.queues.set_limit("q", 2)
    assert len(engine.claim(["q", "q"], "w1", 10)) == 2
    assert engine.claim(["q", "q", "r"], "w2", 10) == []
    assert _sql(db_url, "SELECT count(*) FROM task_instances WHERE state = 'RUNNING'") == [(2,)]


def test_a_limit_set_while_attempts_run_counts_them(db_url: str, engine: Engine) -> None:
    """Attempts claimed while the queue had no limit hold places once one is set: no new
    attempt starts until the queue is under it; an attempt that ends frees its place at the
    coordinator's next pass."""
    for _ in range(5):
        engine.start("low")
    running = engine.claim(["q"], "w1", 3)
    assert len(running) == 3
    engine.queues.set_limit("q", 2)
    assert engine.claim(["q"], "w2", 10) == []
    assert {r.queue: r for r in engine.queues.list()}["q"].slots == 3
    engine.complete(running[0], None)
    engine.complete(running[1], None)
    assert engine.claim(["q"], "w2", 10) == []                 # freed by the pass, not at once
    assert engine.coordinator().run_once(["leases"]).slots_freed == 2
    assert len(engine.claim(["q"], "w2", 10)) == 1             # 2 RUNNING: the limit
    assert engine.claim(["q"], "w3", 10) == []
    assert _sql(db_url, "SELECT count(*) FROM task_instances WHERE state = 'RUNNING'") == [(2,)]


def test_a_limit_set_while_a_report_ends_its_attempt_does_not_wait_for_it(db_url: str, engine: Engine) -> None:
    """A report whose write freed its place (not committed: it is making the claim of its
    worker's next tasks) does not hold up a new limit: the limit's places leave alone the
    tasks whose place its snapshot sees, so its insert meets no row being deleted."""
    for _ in range(4):
        engine.start("low")
    engine.queues.set_limit("q", 5)
    first = engine.claim(["q"], "w1", 2)
    ask = engine.next_claim(["q"], "w1", 1)
    done: list[Any] = []
    with psycopg.connect(db_url, autocommit=True) as blocker:   # the report stops at its claim's first lock
        blocker.execute("SELECT pg_advisory_lock(hashtext('composer_claim'), hashtext(%s))", (ask.claim_id,))
        report = threading.Thread(target=lambda: done.append(engine.complete(first[0], None, claim_next=ask)))
        report.start()
        wait_for(lambda: _sql(db_url, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'")
                 == [(1,)], timeout=30, what="the report waiting at its claim")
        changes: list[Any] = []
        setter = threading.Thread(target=lambda: changes.append(engine.queues.set_limit("q", 3)))
        setter.start()
        wait_for(lambda: changes, timeout=30, what="the limit, set while the report is open")
        assert changes[0].applied and not done
        blocker.execute("SELECT pg_advisory_unlock(hashtext('composer_claim'), hashtext(%s))", (ask.claim_id,))
    report.join(timeout=30)
    assert done and len(done[0].claimed) == 1
    assert _sql(db_url, "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()") == [(0,)]
    assert _sql(db_url, "SELECT count(*) FROM flow_slots") == [(2,)]


def test_the_pass_does_not_free_a_place_its_next_attempt_took_over(db_url: str, engine: Engine) -> None:
    """A place the coordinator's pass finds stale (its attempt ended without the trigger: a
    place made when the limit was set) and the claim of the task's next attempt takes over
    (its upsert) while the pass waits for the row: the pass leaves it, so the limit holds."""
    from composer_ops.repo import outbox

    engine.deploy({"id": "again", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "q",
                                             "retry": {"max_attempts": 3, "initial_backoff_s": 0}}]})
    engine.start("again")
    (first,) = engine.claim(["q"], "w1", 1)                  # claimed while q has no limit
    engine.queues.set_limit("q", 2)                          # a place for it, made by the limit
    engine.fail(first, "transient", retryable=True)          # attempt 1 queued; the place stays
    _sql_write(db_url, "UPDATE task_outbox SET available_at = now() - interval '1 second'")
    freed: list[int] = []
    with psycopg.connect(db_url) as claimer:                 # attempt 1's claim, not committed
        assert [c.attempt for c in outbox.claim(claimer, ["q"], "w2", 1, claim_id="second")] == [1]
        healer = threading.Thread(target=lambda: freed.append(engine.coordinator().run_once(["leases"]).slots_freed))
        healer.start()
        wait_for(lambda: _sql(db_url, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'transactionid'")
                 == [(1,)], timeout=30, what="the pass waiting for the claim's row")
        claimer.commit()
    healer.join(timeout=60)
    assert freed == [0]
    assert _sql(db_url, "SELECT key, attempt FROM flow_slots") == [("queue:q", 1)]
    for _ in range(3):
        engine.start("low")
    assert len(engine.claim(["q"], "w3", 10)) == 1           # 2 RUNNING: the limit
    assert _sql(db_url, "SELECT count(*) FROM task_instances WHERE state = 'RUNNING'") == [(2,)]


def test_a_limit_takes_over_the_place_of_an_earlier_attempt_not_yet_freed(db_url: str, engine: Engine) -> None:
    """A task whose earlier attempt still has a place (the limit lifted and set again before
    the coordinator's pass freed it): the attempt running gets it, so the pass that then
    runs frees nothing and the limit holds."""
    engine.deploy({"id": "again", "nodes": [{"id": "t", "type": "TASK", "task": "work", "queue": "q",
                                             "retry": {"max_attempts": 3, "initial_backoff_s": 0}}]})
    engine.start("again")
    (first,) = engine.claim(["q"], "w1", 1)                  # attempt 0, no limit
    engine.queues.set_limit("q", 1)                          # its place
    engine.queues.set_limit("q", 0)
    engine.fail(first, "transient", retryable=True)          # attempt 0 over; its place stays
    _sql_write(db_url, "UPDATE task_outbox SET available_at = now() - interval '1 second'")
    (second,) = engine.claim(["q"], "w1", 1)                 # attempt 1, no limit: no place of its own
    assert second.attempt == first.attempt + 1
    engine.queues.set_limit("q", 1)
    assert _sql(db_url, "SELECT key, attempt FROM flow_slots") == [("queue:q", second.attempt)]
    assert engine.coordinator().run_once(["leases"]).slots_freed == 0
    for _ in range(3):
        engine.start("low")
    assert engine.claim(["q"], "w2", 10) == []
    assert _sql(db_url, "SELECT count(*) FROM task_instances WHERE state = 'RUNNING'") == [(1,)]


def _sql_write(url: str, query: str) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(query)
