"""``engine.schedules`` (composer_ops/engine/schedules.py) against a real PostgreSQL with a
frozen database clock: slots start on time and across daylight-saving days, catch-up
and overlap policies after an outage, pause/resume, trigger, backfill, and the audit
row of every action."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.core.schedules import slot_run_id
from composer_ops.errors import Conflict, Invalid, NotFound
from tests.integration.schedule_clock import FrozenClock

SPEC = {"id": "nightly", "nodes": [{"id": "work", "type": "TASK", "task": "work"}]}
START = datetime(2026, 3, 28, 12, 0, tzinfo=UTC)


@pytest.fixture
def frozen(db_url: str) -> FrozenClock:
    clock = FrozenClock(db_url, START)
    clock.months(date(2026, 1, 1), 11)
    return clock


@pytest.fixture
def engine(frozen: FrozenClock) -> Iterator[Engine]:
    with Engine.connect(frozen.url, pool_size=4) as e:
        e.deploy(SPEC)
        yield e


def _rows(url: str, query: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(query, params).fetchall()


def _runs(url: str) -> list[tuple[str, Any]]:
    """Every run with the 'started' history detail its start wrote, by run ID."""
    return [(r[0], r[1]) for r in _rows(url, """
        SELECT r.id, h.detail FROM workflow_runs r JOIN run_history h ON h.run_id = r.id AND h.kind = 'started'
         ORDER BY r.id""")]


def _slots(url: str) -> list[str]:
    return [d["slot"] for _, d in _runs(url)]


def _pass(engine: Engine, **kw: Any) -> Any:
    return engine.schedules.fire_due(**kw)


def test_create_refuses_bad_input_and_writes_nothing(engine: Engine, frozen: FrozenClock) -> None:
    for kw, message in ((dict(cron="0 2 * * 8"), "field 5 \\(day-of-week\\)"),
                        (dict(timezone="Europe/Pariss"), "time zone 'Europe/Pariss' is unknown"),
                        (dict(overlap="never"), "overlap 'never' is not one of"),
                        (dict(catchup="most"), "catchup 'most' is not one of"),
                        (dict(input=[1, 2]), "schedule input must be a JSON object")):
        args: dict[str, Any] = {"workflow": "nightly", "cron": "30 2 * * *", "timezone": "Europe/Paris", **kw}
        with pytest.raises(Invalid, match=message):
            engine.schedules.create("n", **args)
    with pytest.raises(NotFound, match="workflow 'nope' does not exist"):
        engine.schedules.create("n", workflow="nope", cron="30 2 * * *", timezone="UTC")
    assert _rows(frozen.db_url, "SELECT count(*) FROM schedules") == [(0,)]
    assert _rows(frozen.db_url, "SELECT count(*) FROM operator_audit") == [(0,)]


def test_spring_forward_slot_fires_once_at_the_first_minute_that_exists(engine: Engine,
                                                                        frozen: FrozenClock) -> None:
    """02:30 does not exist in Paris on 2026-03-29: the slot is 03:00 CEST (01:00Z), once."""
    made = engine.schedules.create("paris", workflow="nightly", cron="30 2 * * *", timezone="Europe/Paris",
                                   input={"k": 1})
    assert made.next_slot_at == datetime(2026, 3, 29, 1, 0, tzinfo=UTC)
    frozen.set(datetime(2026, 3, 29, 0, 59, 59, tzinfo=UTC))
    assert _pass(engine).started == 0
    frozen.set(datetime(2026, 3, 29, 1, 0, 0, 500_000, tzinfo=UTC))
    assert _pass(engine).started == 1
    assert _pass(engine).started == 0                                # decided: the cursor moved on
    [(run_id, detail)] = _runs(frozen.db_url)
    assert detail == {"schedule": "paris", "schedule_id": made.id, "slot": "2026-03-29T01:00:00.000Z",
                      "source": "cron"}
    assert run_id == slot_run_id(made.id, "cron", datetime(2026, 3, 29, 1, tzinfo=UTC))
    run = engine.get_run(run_id)
    assert run.input == {"k": 1, "_schedule": {"name": "paris", "slot": "2026-03-29T01:00:00.000Z",
                                              "source": "cron"}}
    assert engine.schedules.get("paris").next_slot_at == datetime(2026, 3, 30, 0, 30, tzinfo=UTC)


def test_repeated_hour_fires_in_its_first_pass_only(engine: Engine, frozen: FrozenClock) -> None:
    """02:30 happens twice in Paris on 2026-10-25: the slot is the first (CEST, 00:30Z)."""
    frozen.set(datetime(2026, 10, 24, 12, tzinfo=UTC))
    engine.schedules.create("paris", workflow="nightly", cron="30 2 * * *", timezone="Europe/Paris")
    for minute in range(0, 24 * 60, 15):                 # a pass every 15 minutes through the day
        frozen.set(datetime(2026, 10, 24, 22, tzinfo=UTC) + timedelta(minutes=minute))
        _pass(engine)
    assert _slots(frozen.db_url) == ["2026-10-25T00:30:00.000Z"]


def test_catchup_after_an_outage(engine: Engine, frozen: FrozenClock) -> None:
    """No coordinator ran for two hours and a half (slots every 30 minutes): ``all``
    starts the five slots (overlap allow), ``latest`` the newest, ``none`` nothing; the
    others are recorded as missed with the policy's reason."""
    for name, catchup in (("all", "all"), ("latest", "latest"), ("none", "none")):
        engine.schedules.create(name, workflow="nightly", cron="*/30 * * * *", timezone="UTC",
                                catchup=catchup, overlap="allow")
    frozen.set(START + timedelta(hours=2, minutes=31, seconds=5))     # 14:30 is 65 s late: past the grace
    done = _pass(engine)
    assert done.started == 5 + 1 + 0 and done.missed == 0 + 4 + 5
    by_schedule: dict[str, list[str]] = {}
    for _, d in _runs(frozen.db_url):
        by_schedule.setdefault(d["schedule"], []).append(d["slot"])
    assert by_schedule == {"all": [f"2026-03-28T{h}:00.000Z" for h in ("12:30", "13:00", "13:30", "14:00",
                                                                        "14:30")],
                           "latest": ["2026-03-28T14:30:00.000Z"]}
    listed = {s.name: s for s in engine.schedules.list()}
    assert (listed["latest"].missed_slots, listed["none"].missed_slots, listed["all"].missed_slots) == (4, 5, 0)
    assert "catchup none" in (listed["none"].last_not_started_reason or "")
    assert all(s.next_slot_at == datetime(2026, 3, 28, 15, tzinfo=UTC) for s in listed.values())


def test_overlap_skip_and_buffer_one_judge_the_previous_run(engine: Engine, frozen: FrozenClock) -> None:
    skip = engine.schedules.create("skip", workflow="nightly", cron="*/10 * * * *", timezone="UTC", catchup="all")
    buffer = engine.schedules.create("buffer", workflow="nightly", cron="*/10 * * * *", timezone="UTC",
                                     overlap="buffer_one", catchup="all")
    frozen.set(START + timedelta(minutes=10))
    assert _pass(engine).started == 2
    frozen.set(START + timedelta(minutes=30))                    # 12:20 and 12:30 due; both runs active
    done = _pass(engine)
    assert (done.started, done.skipped, done.buffered) == (0, 3, 1)
    assert engine.schedules.get("buffer").buffered_slot_at == START + timedelta(minutes=20)
    first_buffer_run = slot_run_id(buffer.id, "cron", START + timedelta(minutes=10))
    engine.cancel(first_buffer_run)                              # the active run ends
    engine.cancel(slot_run_id(skip.id, "cron", START + timedelta(minutes=10)))
    frozen.set(START + timedelta(minutes=30, seconds=6))         # the buffered slot's poll has come
    assert _pass(engine).started == 1
    assert engine.schedules.get("buffer").last_slot_at == START + timedelta(minutes=20)
    frozen.set(START + timedelta(minutes=40))
    assert _pass(engine).started == 1                            # skip: its run ended, 12:40 starts
    slots = sorted((d["schedule"], d["slot"]) for _, d in _runs(frozen.db_url))
    assert slots == [("buffer", "2026-03-28T12:10:00.000Z"), ("buffer", "2026-03-28T12:20:00.000Z"),
                     ("skip", "2026-03-28T12:10:00.000Z"), ("skip", "2026-03-28T12:40:00.000Z")]


def test_pause_resume_delete_and_their_audit(engine: Engine, frozen: FrozenClock) -> None:
    engine.schedules.create("p", workflow="nightly", cron="0 * * * *", timezone="UTC")
    assert engine.schedules.pause("p") is True and engine.schedules.pause("p") is False
    frozen.set(START + timedelta(hours=3, minutes=30))
    assert _pass(engine).started == 0                              # paused: no slot starts
    assert engine.schedules.resume("p") is True
    assert engine.schedules.get("p").next_slot_at == START + timedelta(hours=4)   # paused slots are not run
    frozen.set(START + timedelta(hours=4))
    assert _pass(engine).started == 1
    engine.schedules.delete("p")
    with pytest.raises(NotFound, match="schedule 'p' does not exist"):
        engine.schedules.pause("p")
    frozen.set(START + timedelta(hours=5))
    assert _pass(engine).started == 0
    assert [r[0] for r in _rows(frozen.db_url, "SELECT action FROM operator_audit ORDER BY id")] == [
        "schedules create", "schedules pause", "schedules pause", "schedules resume", "schedules delete"]
    engine.schedules.create("p", workflow="nightly", cron="0 * * * *", timezone="UTC")   # the name is free again
    with pytest.raises(Conflict, match="schedule 'p' already exists"):
        engine.schedules.create("p", workflow="nightly", cron="0 * * * *", timezone="UTC")


def test_trigger_starts_one_run_now(engine: Engine, frozen: FrozenClock) -> None:
    engine.schedules.create("t", workflow="nightly", cron="0 2 * * *", timezone="UTC", input={"a": 1})
    run_id = engine.schedules.trigger("t")
    assert engine.get_run(run_id).input["_schedule"] == {"name": "t", "slot": "2026-03-28T12:00:00.000Z",
                                                          "source": "trigger"}
    assert engine.schedules.get("t").last_run_id == run_id
    [(action, counts, detail)] = _rows(frozen.db_url, """
        SELECT action, counts, detail FROM operator_audit WHERE action = 'schedules trigger'""")
    assert counts == {"runs": 1} and detail["run_id"] == run_id


def test_backfill_dry_run_then_yes(engine: Engine, frozen: FrozenClock) -> None:
    made = engine.schedules.create("b", workflow="nightly", cron="0 6 * * *", timezone="Europe/Paris")
    frozen.set(datetime(2026, 3, 10, 12, tzinfo=UTC))
    engine.schedules.trigger("b")                                        # not a cron slot: no clash
    frozen.set(START)
    dry = engine.schedules.backfill("b", start="2026-03-20", end="2026-03-27")
    assert not dry.applied and [s.action for s in dry.slots] == ["start"] * 7
    assert dry.slots[0].slot == datetime(2026, 3, 20, 5, tzinfo=UTC)      # 06:00 CET
    assert len(_runs(frozen.db_url)) == 1
    done = engine.schedules.backfill("b", start="2026-03-20", end="2026-03-27", yes=True)
    assert done.applied and done.started == 7
    again = engine.schedules.backfill("b", start="2026-03-24", end="2026-03-28T12:00:00Z", yes=True)
    assert [s.action for s in again.slots] == ["exists", "exists", "exists", "start", "start"]
    assert again.started == 2 and len(_runs(frozen.db_url)) == 1 + 7 + 2
    assert {r for r, _ in _runs(frozen.db_url)} >= {slot_run_id(made.id, "cron", s.slot) for s in again.slots}
    with pytest.raises(Invalid, match=r"backfill slot 2025-12-31T05:00:00.000Z falls in month 202512, which has "
                                      r"no partition"):
        engine.schedules.backfill("b", start="2025-12-31", end="2026-01-02")
    with pytest.raises(Invalid, match="is after the database clock"):
        engine.schedules.backfill("b", start="2026-03-27", end="2026-04-02")
    with pytest.raises(Invalid, match="--from 'yesterday' is not an ISO date"):
        engine.schedules.backfill("b", start="yesterday", end="2026-03-27")
    assert [r[0] for r in _rows(frozen.db_url, "SELECT counts->>'runs' FROM operator_audit "
                                               "WHERE action = 'schedules backfill' ORDER BY id")] == ["7", "2"]


def test_a_disabled_workflow_misses_its_slot_and_the_schedule_goes_on(engine: Engine,
                                                                      frozen: FrozenClock) -> None:
    engine.schedules.create("d", workflow="nightly", cron="0 * * * *", timezone="UTC")
    engine.set_enabled("nightly", False)
    frozen.set(START + timedelta(hours=1))
    done = _pass(engine)
    assert (done.started, done.missed, done.errors) == (0, 1, [])
    [row] = [s for s in engine.schedules.list() if s.name == "d"]
    assert "disabled" in (row.last_not_started_reason or "") and row.next_slot_at == START + timedelta(hours=2)


def test_two_coordinators_racing_start_each_slot_once(engine: Engine, frozen: FrozenClock) -> None:
    """Two coordinators (engines of their own) released together on the same due slots:
    one run per slot, and between them they report each start once."""
    import threading

    for i in range(12):
        engine.schedules.create(f"r{i}", workflow="nightly", cron="*/10 * * * *", timezone="UTC", catchup="all",
                                overlap="allow")
    frozen.set(START + timedelta(hours=1))                       # 12:10 ... 13:00 due: 6 slots each
    gate = threading.Barrier(2)
    started: list[int] = []

    def coordinator() -> None:
        with Engine.connect(frozen.url, pool_size=2) as mine:
            gate.wait(timeout=60)
            for _ in range(20):
                stats = mine.coordinator(batch=5).run_once(["schedules"])
                assert not stats.errors, stats.errors
                started.append(stats.schedule_runs_started)

    threads = [threading.Thread(target=coordinator) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    fired = [(d["schedule"], d["slot"]) for _, d in _runs(frozen.db_url)]
    assert len(fired) == len(set(fired)) == 12 * 6 and sum(started) == 12 * 6
    assert _rows(frozen.db_url, "SELECT count(*) FROM schedule_events WHERE kind = 'started'") == [(72,)]


def test_check_alerts_on_a_schedule_whose_due_slot_did_not_start(engine: Engine, frozen: FrozenClock) -> None:
    from composer_ops.ops.health import Thresholds, check_health

    def late() -> tuple[bool, str]:
        [found] = [c for c in check_health(frozen.url, Thresholds(schedule_late_s=300)).checks
                   if c.metric == "composer_schedules_late"]
        assert found.runbook == "schedule_late"
        return found.alert, found.detail

    engine.schedules.create("h", workflow="nightly", cron="0 * * * *", timezone="UTC", overlap="allow")
    frozen.set(START + timedelta(hours=1, minutes=4))          # 13:00 due 4 minutes ago: within the threshold
    assert late()[0] is False
    frozen.set(START + timedelta(hours=1, minutes=6))          # no coordinator: 6 minutes overdue
    alert, detail = late()
    assert alert and "slot 2026-03-28T13:00:00Z is 6 min overdue" in detail
    _pass(engine)                                             # catch-up latest starts it, late as it is
    assert late()[0] is False
    engine.set_enabled("nightly", False)
    frozen.set(START + timedelta(hours=2))
    _pass(engine)
    alert, detail = late()
    assert alert and "slot 2026-03-28T14:00:00Z was missed: workflow 'nightly' is disabled" in detail
    engine.set_enabled("nightly", True)
    frozen.set(START + timedelta(hours=3))
    _pass(engine)
    assert late()[0] is False


def test_a_schedule_edited_into_nonsense_by_hand_does_not_stop_the_others(engine: Engine,
                                                                          frozen: FrozenClock) -> None:
    engine.schedules.create("bad", workflow="nightly", cron="0 * * * *", timezone="UTC")
    engine.schedules.create("good", workflow="nightly", cron="0 * * * *", timezone="UTC")
    with psycopg.connect(frozen.db_url) as conn:
        # First in the pass: its wake-up is the oldest.
        conn.execute("UPDATE schedules SET cron = '0 99 * * *', wake_at = wake_at - interval '1 minute' "
                     "WHERE name = 'bad'")
    frozen.set(START + timedelta(hours=1))
    stats = engine.coordinator().run_once(["schedules"])
    assert stats.schedule_runs_started == 1 and len(stats.errors) == 1 and "schedule " in stats.errors[0]
    assert [d["schedule"] for _, d in _runs(frozen.db_url)] == ["good"]
