"""An event's one write (repo/writes.py, statement) updates the run's month partitions by
name, on a plan psycopg prepared and the server cached, and locks that month only,
however many months are retained; a month made later is written the same way, and one
that cannot be named (misaligned, say) on the partitioned tables, planned at every call
for its month only.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

import psycopg

from composer_ops.core.model import TaskRef
from composer_ops.core.runids import uuid7_bound as partitions_bound
from composer_ops.repo import clock, partitions, tasks, writes
from composer_ops.repo.rows import HistoryEntry
from tests.integration.helpers import add_definition, add_run, now_utc

_RELATION_LOCKS = "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'"
_TASK_PARTITIONS_LOCKED = """
    SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
     WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'
       AND c.relname ~ '^(task_instances|workflow_runs)_p' AND c.relkind = 'r'"""
_PLANS = """SELECT generic_plans, custom_plans FROM pg_prepared_statements
             WHERE statement LIKE '/* composer_event */%%' AND statement LIKE %s"""


def _running_task(conn: Any, run_id: str) -> TaskRef:
    task_id = f"{run_id[:8]}-a"
    tasks.insert_task(conn, run_id, task_id=task_id, node_id="a", node_type="TASK", queue="default",
                      state="RUNNING", now=clock.now(conn))
    return TaskRef(task_id=task_id, run_id=run_id, node_id="a", attempt=0, lease_owner=None)


def _complete(conn: Any, ref: TaskRef) -> None:
    doc = writes.document(
        at=clock.now(conn), run_id=ref.run_id, request=None, exact=True,
        done=[writes.Done(ref=ref, output={"ok": 1}, entry=HistoryEntry(kind="completed", worker="w"))],
        finish=writes.Finish(status="COMPLETED", reason=None, output={"ok": 1}))
    writes.send(conn, doc).result()


def _one_completion(conn: Any, at: datetime | None = None) -> tuple[int, set[str]]:
    """Complete the task of a new run (minted ``at``) and finish the run, committed (a
    ROLLBACK would make psycopg forget what it prepared): the relation locks the write
    holds, and the month partitions among them."""
    ref = _running_task(conn, add_run(conn, at=at))
    with conn.transaction():
        base = conn.execute(_RELATION_LOCKS).fetchone()[0]
        _complete(conn, ref)
        held = conn.execute(_RELATION_LOCKS).fetchone()[0] - base
        locked = {r[0] for r in conn.execute(_TASK_PARTITIONS_LOCKED).fetchall()}
    return held, locked


def _plans(conn: Any, table: str) -> list[tuple[int, int]]:
    return [(int(r[0]), int(r[1])) for r in conn.execute(_PLANS, (f'%UPDATE "{table}"%',)).fetchall()]


def _months_ago(n: int) -> date:
    today = now_utc().date()
    total = today.year * 12 + today.month - 1 - n
    return date(total // 12, total % 12 + 1, 1)


def test_a_completion_writes_its_months_partitions_on_a_cached_plan_and_locks_that_month_only(
        db_url: str) -> None:
    month = f"{now_utc():%Y%m}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        # psycopg prepares it at its sixth call; the server makes five custom plans, then the generic one
        runs = [_one_completion(conn) for _ in range(12)]
        assert {frozenset(r[1]) for r in runs} == {frozenset({f"task_instances_p{month}", f"workflow_runs_p{month}"})}
        ((generic, custom),) = _plans(conn, f"task_instances_p{month}")
        assert generic >= 1 and custom <= 5, (generic, custom)
        partitions.ensure_from(conn, _months_ago(12), 11)   # a year of past months
        more = [_one_completion(conn) for _ in range(7)]
        assert {frozenset(r[1]) for r in more} == {frozenset({f"task_instances_p{month}", f"workflow_runs_p{month}"})}
        assert more[-1][0] == runs[-1][0]
        ((later, _),) = _plans(conn, f"task_instances_p{month}")
        assert later >= generic + 7


def test_a_month_made_after_the_connection_began_is_written_on_its_own_partitions(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        for _ in range(7):
            _one_completion(conn)
        past = _months_ago(2)
        partitions.ensure_from(conn, past, 0)
        at = datetime(past.year, past.month, 15, tzinfo=now_utc().tzinfo)
        found = [_one_completion(conn, at) for _ in range(7)]
        assert {frozenset(f[1]) for f in found} == {frozenset({f"task_instances_p{past:%Y%m}",
                                                               f"workflow_runs_p{past:%Y%m}"})}
        assert len(_plans(conn, f"task_instances_p{past:%Y%m}")) == 1     # prepared, as any month
        this_month = now_utc().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        done = conn.execute("SELECT count(*) FROM workflow_runs WHERE id < %s AND status = 'COMPLETED'",
                            (partitions_bound(this_month),)).fetchone()
        assert done == (7,)


def test_a_month_that_cannot_be_named_is_written_on_the_partitioned_tables_unprepared(db_url: str) -> None:
    month = f"{now_utc():%Y%m}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
        partitions.ensure_from(conn, _months_ago(12), 11)
        partitions.month_tables(conn, add_run(conn))
        # What month_tables finds for a month whose partitions have other bounds, or
        # which this role may not update (tests/integration/test_partitions_run_tables.py).
        partitions._CHECKED[conn][month] = partitions.PARTITIONED
        runs = [_one_completion(conn) for _ in range(7)]
        assert {frozenset(r[1]) for r in runs} == {frozenset({f"task_instances_p{month}", f"workflow_runs_p{month}"})}
        assert _plans(conn, "task_instances") == []       # never prepared: a custom plan each time
        done = conn.execute("SELECT count(*) FROM workflow_runs WHERE status = 'COMPLETED'").fetchone()
        assert done == (7,)


def test_retention_drops_a_months_functions_with_its_partitions(db_url: str) -> None:
    old = _months_ago(24)
    names = (f"composer_claim_tasks_p{old:%Y%m}", f"composer_load_run_p{old:%Y%m}")
    with psycopg.connect(db_url, autocommit=True) as conn:
        partitions.ensure_from(conn, old, 0)
        exists = "SELECT to_regproc(%s) IS NOT NULL"
        assert [conn.execute(exists, (n,)).fetchone() for n in names] == [(True,)] * 2
        dropped = [r[0] for r in conn.execute(
            "SELECT composer_drop_partitions(now() - interval '400 days', interval '1 hour')").fetchall()]
        assert f"{old:%Y%m}" in dropped
        assert [conn.execute(exists, (n,)).fetchone() for n in names] == [(False,)] * 2
