"""An event's fenced updates (composer_apply's completions and finish) run in the run's
month's own function, on cached plans, and lock that month only, however many months
are retained; a month made later, or one without its function, is written all the same.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

import psycopg

from composer_ops.core.model import TaskRef
from composer_ops.repo import clock, partitions, tasks, writes
from composer_ops.repo.rows import HistoryEntry
from tests.integration.helpers import add_definition, add_run, now_utc

_RELATION_LOCKS = "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'"
_TASK_PARTITIONS_LOCKED = """
    SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
     WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'
       AND c.relname ~ '^(task_instances|workflow_runs)_p' AND c.relkind = 'r'"""
_CALLS = "SELECT COALESCE(pg_stat_get_xact_function_calls(to_regproc(%s)), 0)"


def _running_task(conn: Any, run_id: str) -> TaskRef:
    task_id = f"{run_id[:8]}-a"
    tasks.insert_task(conn, run_id, task_id=task_id, node_id="a", node_type="TASK", queue="default",
                      state="RUNNING", now=clock.now(conn))
    return TaskRef(task_id=task_id, run_id=run_id, node_id="a", attempt=0, lease_owner=None)


def _complete(conn: Any, ref: TaskRef) -> None:
    doc = writes.document(
        at=clock.now(conn), run_id=ref.run_id, request=None,
        done=[writes.Done(ref=ref, output={"ok": 1}, entry=HistoryEntry(kind="completed", worker="w"))],
        finish=writes.Finish(status="COMPLETED", reason=None, output={"ok": 1}))
    writes.send(conn, doc).result()


def _one_completion(conn: Any, ref: TaskRef, month: str) -> tuple[int, set[str], tuple[int, int]]:
    """Complete ``ref`` and finish its run, rolled back: the relation locks the write
    holds, the month partitions among them, and how often it called the month's own
    function and the one on the partitioned tables."""
    names = (f"composer_apply_updates_p{month}", "composer_apply_updates")
    with conn.transaction():
        base = conn.execute(_RELATION_LOCKS).fetchone()[0]
        before = [conn.execute(_CALLS, (name,)).fetchone()[0] for name in names]
        _complete(conn, ref)
        held = conn.execute(_RELATION_LOCKS).fetchone()[0] - base
        locked = {r[0] for r in conn.execute(_TASK_PARTITIONS_LOCKED).fetchall()}
        after = [conn.execute(_CALLS, (name,)).fetchone()[0] for name in names]
        raise psycopg.Rollback()
    return held, locked, (after[0] - before[0], after[1] - before[1])


def _months_ago(n: int) -> date:
    today = now_utc().date()
    total = today.year * 12 + today.month - 1 - n
    return date(total // 12, total % 12 + 1, 1)


def test_a_completion_writes_through_its_months_function_and_locks_that_month_only(db_url: str) -> None:
    month = f"{now_utc():%Y%m}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET track_functions = 'pl'")
        add_definition(conn)
        ref = _running_task(conn, add_run(conn))
        runs = [_one_completion(conn, ref, month) for _ in range(7)]   # plans cached after 5
        assert {r[2] for r in runs} == {(1, 0)}
        assert {frozenset(r[1]) for r in runs} == {frozenset({f"task_instances_p{month}", f"workflow_runs_p{month}"})}
        partitions.ensure_from(conn, _months_ago(12), 11)   # a year of past months
        more = [_one_completion(conn, ref, month) for _ in range(7)]
        assert {frozenset(r[1]) for r in more} == {frozenset({f"task_instances_p{month}", f"workflow_runs_p{month}"})}
        assert more[-1][0] == runs[-1][0]


def test_a_month_made_after_the_write_was_planned_is_written_through_its_own_function(db_url: str) -> None:
    month = f"{now_utc():%Y%m}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET track_functions = 'pl'")
        add_definition(conn)
        ref = _running_task(conn, add_run(conn))
        for _ in range(7):
            _one_completion(conn, ref, month)
        past = _months_ago(2)
        partitions.ensure_from(conn, past, 0)
        old = _running_task(conn, add_run(conn, at=datetime(past.year, past.month, 15, tzinfo=now_utc().tzinfo)))
        held, locked, calls = _one_completion(conn, old, f"{past:%Y%m}")
        assert calls == (1, 0)
        assert locked == {f"task_instances_p{past:%Y%m}", f"workflow_runs_p{past:%Y%m}"}
        _complete(conn, old)
        row = conn.execute("SELECT status FROM workflow_runs WHERE id = %s", (old.run_id,)).fetchone()
        assert row == ("COMPLETED",)


def test_a_month_without_its_function_is_written_on_the_partitioned_tables(db_url: str) -> None:
    month = f"{now_utc():%Y%m}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET track_functions = 'pl'")
        add_definition(conn)
        ref = _running_task(conn, add_run(conn))
        conn.execute(f"DROP FUNCTION composer_apply_updates_p{month}")
        partitions.ensure_from(conn, _months_ago(12), 11)
        held, locked, calls = _one_completion(conn, ref, month)
        assert calls == (0, 1)
        assert locked == {f"task_instances_p{month}", f"workflow_runs_p{month}"}
        remade = conn.execute("SELECT composer_apply_month(%s)", (month,)).fetchone()
        assert remade == (True,)
        assert _one_completion(conn, ref, month)[2] == (1, 0)


def test_retention_drops_a_months_functions_with_its_partitions(db_url: str) -> None:
    old = _months_ago(24)
    names = (f"composer_apply_updates_p{old:%Y%m}", f"composer_claim_tasks_p{old:%Y%m}",
             f"composer_load_run_p{old:%Y%m}")
    with psycopg.connect(db_url, autocommit=True) as conn:
        partitions.ensure_from(conn, old, 0)
        exists = "SELECT to_regproc(%s) IS NOT NULL"
        assert [conn.execute(exists, (n,)).fetchone() for n in names] == [(True,)] * 3
        dropped = [r[0] for r in conn.execute(
            "SELECT composer_drop_partitions(now() - interval '400 days', interval '1 hour')").fetchall()]
        assert f"{old:%Y%m}" in dropped
        assert [conn.execute(exists, (n,)).fetchone() for n in names] == [(False,)] * 3
