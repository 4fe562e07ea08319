"""The timers and the lease sweeper look only at the months from the active floor on.

The floor is the first of the month of the oldest run with an active task, read by the
coordinator every ``floor_every_s``. The scans name it as a constant, so the planner
keeps (and locks) only the months from it on: months of finished history retained
below it cost the scans nothing. These tests check the floor, that the scans lock no
month below it (and did without the floor), that an old run's
expired lease and due timer are still found, and the one delay the floor allows: a run
below it that gets an active task again is seen from the next read of the floor.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, Invalid, Transient
from composer_ops.core import runids
from composer_ops.engine.coordinator import MAX_FLOOR_EVERY_S
from composer_ops.repo import clock, partitions, signals, tasks
from tests.integration.helpers import CoordinatorClock, add_definition, add_run, now_utc


def _months_ago(n: int) -> datetime:
    today = now_utc().date()
    index = today.year * 12 + today.month - 1 - n
    return datetime(index // 12, index % 12 + 1, 15, tzinfo=UTC)


def _month_floor(ts: datetime) -> str:
    return runids.month_bounds(runids.month_label(ts))[0]


_SPEC = {"id": "wf", "nodes": [{"id": "a", "type": "TASK", "task": "t"},
                               {"id": "z", "type": "WAIT", "duration_s": 60}]}


def _task(conn: Any, run_id: str, state: str, *, lease_expired: bool = False, wake_due: bool = False) -> str:
    """A task of ``run_id`` in ``state``: of the TASK node ``a``, with a lease that
    lapsed a minute ago when ``lease_expired``; of the WAIT node ``z`` with a wake-up due
    a minute ago when ``wake_due``."""
    node, node_type = ("z", "WAIT") if wake_due else ("a", "TASK")
    task_id = f"{run_id[:13]}-{node}"
    assert tasks.insert_task(conn, run_id, task_id=task_id, node_id=node, node_type=node_type, queue="default",
                             state=state, now=clock.now(conn))
    if lease_expired:
        conn.execute("UPDATE task_instances SET lease_owner = 'gone', lease_expires_at = now() - interval '1 minute'"
                     " WHERE id = %s", (task_id,))
    if wake_due:
        conn.execute("UPDATE task_instances SET wake_at = now() - interval '1 minute' WHERE id = %s", (task_id,))
    return task_id


def _ensure_months_back(conn: Any, n: int) -> None:
    start = _months_ago(n)
    partitions.ensure_from(conn, date(start.year, start.month, 1), n)


def test_the_floor_is_the_month_of_the_oldest_run_with_an_active_task(engine: Engine, db_url: str) -> None:
    coordinator = engine.coordinator(floor_every_s=0)
    with psycopg.connect(db_url, autocommit=True) as conn:
        _ensure_months_back(conn, 3)
        add_definition(conn, spec=_SPEC)
        max_age_ago = clock.now(conn) - runids.RUN_ID_MAX_AGE - runids.RUN_START_SLACK
        assert coordinator.active_floor(conn) == _month_floor(max_age_ago)      # nothing active
        finished = add_run(conn, at=_months_ago(3))
        _task(conn, finished, "COMPLETED")
        assert coordinator.active_floor(conn) == _month_floor(max_age_ago)      # finished tasks do not count
        old = add_run(conn, at=_months_ago(2))
        old_task = _task(conn, old, "WAITING")
        _task(conn, add_run(conn), "PENDING")
        assert coordinator.active_floor(conn) == _month_floor(_months_ago(2))
        conn.execute("UPDATE task_instances SET state = 'COMPLETED' WHERE id = %s", (old_task,))
        # this month's run: the floor is the month RUN_ID_MAX_AGE + RUN_START_SLACK ago (this one, but the
        # previous one in this month's first two hours)
        assert coordinator.active_floor(conn) == _month_floor(max_age_ago)


_LOCKED_MONTHS = r"""
    SELECT DISTINCT substring(c.relname from '_p([0-9]{6})')
      FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
     WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'
       AND c.relname ~ '^(task_instances|workflow_runs)_p[0-9]{6}'"""


def _months_locked_by_scans(conn: Any, floor: str) -> set[str]:
    """The months (YYYYMM) whose partitions of task_instances or workflow_runs, or
    their indexes, one sweeper scan or one timer scan locks, on a connection where
    both ran 6 times before (prepared after 5)."""
    months: set[str] = set()
    for _ in range(7):
        months = set()
        for scan in (tasks.expired_leases, signals.due_waits):
            with conn.transaction():
                scan(conn, 100, now=clock.now(conn), floor=floor)
                months |= {r[0] for r in conn.execute(_LOCKED_MONTHS).fetchall()}
    return months


def _partition_months(conn: Any) -> set[str]:
    return {r[0][-6:] for r in conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'task_instances'::regclass").fetchall()}


def test_the_scans_lock_no_month_below_the_floor(engine: Engine, db_url: str) -> None:
    """With 12 past months retained and active tasks only in this month, the scans lock
    exactly the months from the floor on, as with no past month; without the floor they
    lock every month (what this test would catch)."""
    coordinator = engine.coordinator(floor_every_s=0)
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn, spec=_SPEC)
        _task(conn, add_run(conn), "RUNNING", lease_expired=True)
        floor = coordinator.active_floor(conn)
        floor_month = runids.month_label(clock.now(conn) - runids.RUN_ID_MAX_AGE - runids.RUN_START_SLACK)
        with_current = _months_locked_by_scans(conn, floor)
        current_months = _partition_months(conn)
        _ensure_months_back(conn, 12)
        assert coordinator.active_floor(conn) == floor == runids.month_bounds(floor_month)[0]
        with_past_year = _months_locked_by_scans(conn, floor)
        unbounded = _months_locked_by_scans(conn, "")
        every_month = _partition_months(conn)
    assert with_current == {m for m in current_months if m >= floor_month}
    assert with_past_year == {m for m in every_month if m >= floor_month}
    assert unbounded == every_month and len(every_month) >= len(with_past_year) + 11


def test_an_old_runs_expired_lease_and_due_timer_are_handled(engine: Engine, db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        _ensure_months_back(conn, 5)
        add_definition(conn, spec=_SPEC)
        leased = _task(conn, add_run(conn, at=_months_ago(5)), "RUNNING", lease_expired=True)
        waiting = _task(conn, add_run(conn, at=_months_ago(4)), "WAITING", wake_due=True)
        _task(conn, add_run(conn), "PENDING")
    stats = engine.coordinator().run_once(["timers", "leases"])
    assert stats.errors == [] and stats.leases_expired == 1 and stats.timers_fired == 1
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows: dict[str, str] = dict(conn.execute("SELECT id, state FROM task_instances WHERE id = ANY(%s)",
                                                 ([leased, waiting],)).fetchall())
    assert rows[leased] == "PENDING" and rows[waiting] != "WAITING"


def test_a_run_below_the_floor_is_swept_from_the_next_read_of_the_floor(engine: Engine, db_url: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    clock = CoordinatorClock(monkeypatch)
    coordinator = engine.coordinator(floor_every_s=1.0)
    with psycopg.connect(db_url, autocommit=True) as conn:
        _ensure_months_back(conn, 2)
        add_definition(conn, spec=_SPEC)
        _task(conn, add_run(conn), "PENDING")
        assert coordinator.run_once(["leases"]).leases_expired == 0          # the floor: this month
        # an old run gets an active task after the read (as an operator's retry does)
        _task(conn, add_run(conn, at=_months_ago(2)), "RUNNING", lease_expired=True)
    assert coordinator.run_once(["leases"]).leases_expired == 0          # below the floor, not seen yet
    clock.advance(1.05)
    assert coordinator.run_once(["leases"]).leases_expired == 1


def test_a_floor_that_is_never_read_again_is_refused(engine: Engine) -> None:
    """An infinite (or NaN, or negative) interval would keep the first floor for ever, so
    a run below it that gets an active task again would never be swept."""
    for bad in (float("inf"), float("nan"), -1.0, MAX_FLOOR_EVERY_S + 1):
        with pytest.raises(Invalid, match="floor_every_s must be 0 to 3600 seconds"):
            engine.coordinator(floor_every_s=bad)
    assert engine.coordinator(floor_every_s=MAX_FLOOR_EVERY_S).floor_every_s == MAX_FLOOR_EVERY_S


def test_a_failed_read_of_the_newest_active_run_keeps_a_ceiling_no_lower_than_the_clocks(
        engine: Engine, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ceiling of the Citus node scans is read with a statement over every shard,
    which fails while a worker node is down. Keeping the last ceiling as it was hid, from
    the nodes still up, the runs of a month begun during the outage: their IDs are above
    it. The clock's part is taken at every pass, so the ceiling is never below the runs
    a start may make now."""
    coordinator = engine.coordinator(floor_every_s=0)
    december = datetime(2026, 12, 31, 23, 50, tzinfo=UTC)
    with psycopg.connect(db_url, autocommit=True) as conn:
        read = coordinator.active_ceiling(conn, december)             # no active run: the clock's part only
        assert read == runids.month_bounds("202612")[1]

        def node_down(conn: Any) -> str | None:
            raise Transient("connection to the remote node failed (a transient database error)")

        monkeypatch.setattr(tasks, "active_ceiling", node_down)
        january = datetime(2027, 1, 1, 0, 1, tzinfo=UTC)
        ceiling = coordinator.active_ceiling(conn, january)
        assert ceiling is not None and ceiling >= runids.month_bounds("202701")[1] > read
        new_run = runids.uuid7_bound(january)
        assert new_run <= ceiling                                     # a January run is scanned
