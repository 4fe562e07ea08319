"""The claim locks only the months of the tasks it claims, however many are retained.

A claim that updates task_instances without a constant run ID keeps every monthly
partition in its plan and locks each with its indexes at every call (6 relations per
month). bench/months.py measures the same on backfilled history; here the months are
empty partitions, which cost a claim exactly as much.
"""

from __future__ import annotations

from datetime import date
from typing import Any

import psycopg
import pytest

from composer_ops.core import runids
from composer_ops.repo import clock, outbox, partitions, tasks
from composer_ops.repo.rows import Dispatch
from tests.integration.helpers import add_definition, add_run, now_utc

_RELATION_LOCKS = "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'"
_TASK_PARTITIONS_LOCKED = """
    SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
     WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'
       AND c.relname LIKE 'task_instances_p%%' AND c.relkind = 'r'"""


def _dispatch(conn: Any, run_id: str) -> None:
    task_id = f"{run_id[:8]}-a"
    now = clock.now(conn)
    assert tasks.insert_task(conn, run_id, task_id=task_id, node_id="a", node_type="TASK", queue="default",
                             state="PENDING", now=now)
    outbox.enqueue(conn, [Dispatch(run_id=run_id, task_id=task_id, attempt=0, queue="default", task_name="t",
                                   lease_s=30)], now=now)


def _locks_of_one_claim(conn: Any) -> tuple[list[int], set[str]]:
    """Relation locks a claim of one task holds at the end of its transaction, for 7
    calls on one connection (psycopg prepares the statement from the 5th; the claim
    function's own statements switch to cached plans after 5 calls), each rolled back
    so the next claims the same task; and every task_instances partition any of them
    locked."""
    held = []
    partitions_locked: set[str] = set()
    for _ in range(7):
        with conn.transaction():
            before = conn.execute(_RELATION_LOCKS).fetchone()[0]
            claimed = outbox.claim(conn, ["default"], "w", 1, task_names=["t"], claim_id="c")
            assert len(claimed) == 1
            held.append(conn.execute(_RELATION_LOCKS).fetchone()[0] - before)
            partitions_locked |= {r[0] for r in conn.execute(_TASK_PARTITIONS_LOCKED).fetchall()}
            raise psycopg.Rollback()
    return held, partitions_locked


def test_a_claim_locks_as_much_with_thirteen_months_retained_as_with_one(db_url: str) -> None:
    """At every call, cached plans or not, the claim locks its task's month only; once
    the plans are cached (the last call) it holds as many locks with 13 months as with 1."""
    this_month = f"task_instances_p{now_utc():%Y%m}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        _dispatch(conn, add_run(conn))
        with_current_months, locked = _locks_of_one_claim(conn)
        assert locked == {this_month}
        today = now_utc().date()
        created = partitions.ensure_from(conn, date(today.year - 1, today.month, 1), 11)
        assert created >= 12            # 12 past months of every run table
        with_past_year, locked = _locks_of_one_claim(conn)
        assert locked == {this_month}
    assert with_past_year[-1] == with_current_months[-1]
    assert max(with_past_year) <= max(with_current_months)


@pytest.mark.parametrize("retained", [0, 12])
def test_a_claim_of_tasks_in_two_months_locks_those_months_only(db_url: str, retained: int) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        today = now_utc().date()
        last_month = date(today.year - (today.month == 1), (today.month - 2) % 12 + 1, 1)
        partitions.ensure_from(conn, last_month, 0)
        if retained:
            partitions.ensure_from(conn, date(today.year - 1, today.month, 1), retained - 1)
        old_run = add_run(conn, at=now_utc().replace(year=last_month.year, month=last_month.month, day=15))
        new_run = add_run(conn)
        _dispatch(conn, old_run)
        _dispatch(conn, new_run)
        with conn.transaction():
            claimed = outbox.claim(conn, ["default"], "w", 2, task_names=["t"], claim_id="c")
            names = {r[0] for r in conn.execute(_TASK_PARTITIONS_LOCKED).fetchall()}
            raise psycopg.Rollback()
    assert {c.run_id for c in claimed} == {old_run, new_run}
    assert names == {f"task_instances_p{last_month:%Y%m}", f"task_instances_p{today:%Y%m}"}


_CALLS = "SELECT COALESCE(pg_stat_get_xact_function_calls(to_regproc(%s)), 0)"


def _claim_calls(conn: Any, month: str) -> tuple[int, int]:
    """One claim of one task, rolled back: how often it called the month's own task
    function and the one on the partitioned tables (track_functions; the session's
    counts not yet reported, so the difference over the claim)."""
    names = (f"composer_claim_tasks_p{month}", "composer_claim_tasks")
    with conn.transaction():
        before = [conn.execute(_CALLS, (name,)).fetchone()[0] for name in names]
        assert len(outbox.claim(conn, ["default"], "w", 1, task_names=["t"], claim_id="c")) == 1
        after = [conn.execute(_CALLS, (name,)).fetchone()[0] for name in names]
        raise psycopg.Rollback()
    return after[0] - before[0], after[1] - before[1]


def test_a_claim_updates_its_month_through_the_months_own_function(db_url: str) -> None:
    """The task update runs on the month's partitions by name, so its plan is cached:
    the function exists for every month made, and the claim calls it."""
    month = f"{now_utc():%Y%m}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET track_functions = 'pl'")
        add_definition(conn)
        _dispatch(conn, add_run(conn))
        assert _claim_calls(conn, month) == (1, 0)
        today = now_utc().date()
        partitions.ensure_from(conn, date(today.year - 1, today.month, 1), 0)
        made = conn.execute("SELECT to_regproc(%s) IS NOT NULL",
                            (f"composer_claim_tasks_p{today.year - 1}{today.month:02d}",)).fetchone()
        assert made and made[0]


def test_a_month_without_its_function_is_claimed_on_the_partitioned_tables(db_url: str) -> None:
    """A month whose function is missing (made by hand, or misaligned) is claimed all
    the same, planned per call so it still locks its own month only; remade, the
    month's function takes over again."""
    month = f"{now_utc():%Y%m}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET track_functions = 'pl'")
        add_definition(conn)
        _dispatch(conn, add_run(conn))
        conn.execute(f"DROP FUNCTION composer_claim_tasks_p{month}")
        assert _claim_calls(conn, month) == (0, 1)
        held, locked = _locks_of_one_claim(conn)
        assert locked == {f"task_instances_p{month}"}
        today = now_utc().date()
        partitions.ensure_from(conn, date(today.year - 1, today.month, 1), 11)
        held_past_year, locked = _locks_of_one_claim(conn)
        assert locked == {f"task_instances_p{month}"}
        assert held_past_year[-1] == held[-1]
        remade = conn.execute("SELECT composer_claim_month(%s)", (month,)).fetchone()
        assert remade and remade[0]
        assert _claim_calls(conn, month) == (1, 0)


def test_a_month_dropped_while_the_claim_is_cached_leaves_other_months_claimable(db_url: str) -> None:
    """Retention drops a past month after this connection's claims cached their plans:
    the next claims, of this month's tasks, go on (the dropped month's function is
    never called: its runs had no tasks to claim)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        today = now_utc().date()
        old = date(today.year - 2, today.month, 1)
        partitions.ensure_from(conn, old, 0)
        _dispatch(conn, add_run(conn))
        _locks_of_one_claim(conn)
        with psycopg.connect(db_url, autocommit=True) as other:
            dropped = [r[0] for r in other.execute(
                "SELECT composer_drop_partitions(now() - interval '400 days', interval '1 hour')").fetchall()]
        assert f"{old:%Y%m}" in dropped
        held, locked = _locks_of_one_claim(conn)
        assert locked == {f"task_instances_p{today:%Y%m}"}


def _uuid7(ms: int) -> str:
    h = format(ms, "012x")
    return f"{h[:8]}-{h[8:12]}-7abc-8def-0123456789ab"


def test_the_claims_month_of_a_run_id_is_the_one_its_partition_holds(db_url: str) -> None:
    """composer_run_month, which picks the month's function, agrees with month_of (the
    partition's name) on each side of a month's first millisecond, and gives NULL (the
    partitioned tables) for text that is not a canonical UUIDv7."""
    starts = [runids.month_start(m) for m in ("197001", "202601", "202612", "203002")]
    ids = [_uuid7(int(s.timestamp() * 1000) + d) for s in starts for d in (0, 1) if s.timestamp() * 1000 + d >= 0]
    ids += [_uuid7(int(s.timestamp() * 1000) - 1) for s in starts[1:]]
    with psycopg.connect(db_url, autocommit=True) as conn:
        for run_id in ids:
            row = conn.execute("SELECT composer_run_month(%s)", (run_id,)).fetchone()
            assert row == (runids.month_of(run_id),), run_id
        for text in ("not-a-uuid", ids[2].upper(), ids[2].replace("-7abc-", "-4abc-"), ""):
            assert conn.execute("SELECT composer_run_month(%s)", (text,)).fetchone() == (None,)


def test_a_function_that_turns_a_plan_type_off_turns_jit_off(db_url: str) -> None:
    """A function setting ``enable_<plan> = off`` (the claim: sql/R__claim.sql) makes any
    plan it still needs of that type cost 10^10, far over ``jit_above_cost``: on a server
    with JIT (Debian's PostgreSQL 15) every call compiled it, 140 to 270 ms. Each such
    function sets ``jit = off`` too; the claim is one."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("""
            SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND EXISTS (SELECT 1 FROM unnest(p.proconfig) AS c(s) WHERE c.s ~ '^enable_[a-z_]+=off$')""").fetchall()
    assert any(name.startswith("composer_claim(") for name, _ in rows), rows
    assert [name for name, config in rows if "jit=off" not in config] == []


def test_the_dispatch_keeps_its_plans(db_url: str) -> None:
    """composer_enqueue (sql/R__dispatch.sql) runs with generic plans: with the default
    plan cache mode its walk over task_waiters, whose pass is a parameter, kept choosing
    custom plans, planned at every open, twice per start (0.22 ms of planning per run in
    bench/results/profile-pg15-2026-12-05-df3145a.json). It reads and writes only
    unpartitioned tables, so a generic plan locks nothing more."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT proconfig FROM pg_proc WHERE oid = 'composer_enqueue(jsonb, timestamptz, "
                           "interval, text[], text[], int[], int[])'::regprocedure").fetchone()
    assert row is not None and "plan_cache_mode=force_generic_plan" in (row[0] or []), row
