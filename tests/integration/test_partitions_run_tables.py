"""An event's statements address the run's month partitions by name (repo.partitions.run_tables).

On a partitioned table, a statement that names a run is planned at every call: the plan
cache keeps custom plans, since a generic one would lock every month before pruning.
On the month's partition the statement is an ordinary table's, cached after five
calls. These tests hold that, and the cases where the name cannot be trusted: a month
whose partitions have other bounds, and one dropped or detached after a connection
checked it.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from composer_ops import Engine
from composer_ops.core.model import TaskRef
from composer_ops.db.errors import TranslatingConnection
from composer_ops.errors import NotFound, Transient
from composer_ops.repo import archive, partitions, runs, tasks
from composer_ops.testing.fixtures import _misaligned_month
from tests.integration.helpers import add_definition, add_run, now_utc, uuid7_at

_PLANS = """SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
             WHERE statement LIKE %s"""


def _plans(conn: Any, pattern: str) -> list[tuple[str, int, int]]:
    return [(str(r[0]), int(r[1]), int(r[2])) for r in conn.execute(_PLANS, (pattern,)).fetchall()]


def test_the_events_of_a_run_reuse_cached_plans_on_its_month(db_url: str) -> None:
    """Fifteen 1-task runs started, claimed and completed over one session: the run's
    lock and load (its month's function, ``composer_load_run_pYYYYMM``), the start's one
    statement and the completion's (repo/writes.py, on the month's partitions) are each
    planned at most five times (psycopg prepares from the fifth call; the server tries
    five custom plans before it compares), then run on the cached generic plan."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_definition(conn)
    with Engine.connect(db_url, pool_size=1, application_name="test-plans") as engine:
        for _ in range(15):
            engine.start("wf")
            (claim,) = engine.claim(["default"], "w", 1, task_names=["t"])
            engine.complete(claim, {"ok": True})
        with engine.pool.connection() as conn:
            month = f"{now_utc():%Y%m}"
            found = {
                "load": _plans(conn, f'%"composer_load_run_p{month}"%'),
                "start": _plans(conn, "/* composer_event */%INSERT INTO workflow_runs%"),
                "completion": _plans(conn, f'/* composer_event */%UPDATE "task_instances_p{month}"%'),
            }
    for name, plans in found.items():
        assert len(plans) == 1, f"{name}: {plans}"
        (_, generic, custom), = plans
        assert generic >= 5 and custom <= 5, f"{name}: {generic} generic and {custom} custom plans"


_PARTITIONS_LOCKED = """
    SELECT c.relname::text FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
     WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'
       AND c.relname ~ '^(task_instances|workflow_runs)_p' AND c.relkind = 'r'"""


def test_the_lock_and_load_locks_its_months_partitions_only(db_url: str) -> None:
    """With a year of months retained, a run's lock and load takes the locks of its
    month's partitions only: through the month's own function, and through
    composer_load_run on the partitioned tables for a month without one (on Citus every
    month), which is planned with the run's ID."""
    month = f"{now_utc():%Y%m}"
    today = now_utc().date()
    with TranslatingConnection.connect(db_url, autocommit=True) as setup:
        add_definition(setup)
        partitions.ensure_from(setup, date(today.year - 1, today.month, 1), 11)
        run_id = add_run(setup)
        tasks.insert_task(setup, run_id, task_id=f"{run_id[:8]}-a", node_id="a", node_type="TASK",
                          queue="default", state="PENDING", now=now_utc())
    own = {f"workflow_runs_p{month}", f"task_instances_p{month}"}
    for load in (f"composer_load_run_p{month}", "composer_load_run"):
        with TranslatingConnection.connect(db_url) as conn:
            for _ in range(7):                         # past the five custom plans
                assert partitions.month_tables(conn, run_id).load == load
                row, loaded = runs.lock_and_load(conn, run_id)
                assert row.id == run_id and set(loaded) == {"a"}
                assert {r[0] for r in conn.execute(_PARTITIONS_LOCKED).fetchall()} == own
                conn.rollback()
            conn.execute(f"DROP FUNCTION IF EXISTS composer_load_run_p{month}".encode())
            conn.commit()


def test_a_month_whose_partitions_have_other_bounds_is_read_through_the_partitioned_tables(
        conn: TranslatingConnection[Any]) -> None:
    """December 2024 made an hour early (as a UTC+1 session once made it): a run of
    2024-11-30 23:30 UTC is in ``workflow_runs_p202412``, not in the month its ID names,
    and one of 2024-12-15 is in a partition whose bounds are not December's; both are
    found, through the partitioned tables. An aligned month is addressed by name."""
    add_definition(conn)
    _misaligned_month(conn)
    early = uuid7_at(datetime(2024, 11, 30, 23, 30, tzinfo=UTC))   # no p202411: inserted as a restore would
    conn.execute("""INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, created_at,
                                               updated_at)
                    VALUES (%s, 'wf', 1, 'RUNNING', now(), now())""", (early,))
    mid = add_run(conn, at=datetime(2024, 12, 15, tzinfo=UTC))
    current = add_run(conn)
    for run_id in (early, mid):
        assert partitions.run_tables(conn, run_id) == ("workflow_runs", "task_instances")
        row, _ = runs.lock_and_load(conn, run_id)
        assert row.id == run_id
    assert partitions._CHECKED[conn]["202412"] == partitions.PARTITIONED   # kept: not checked at every event
    month = f"{now_utc():%Y%m}"
    assert partitions.run_tables(conn, current) == (f"workflow_runs_p{month}", f"task_instances_p{month}")
    assert runs.lock_and_load(conn, current)[0].id == current
    assert partitions.run_tables(conn, "not-a-uuid") == ("workflow_runs", "task_instances")


def _last_year(conn: Any) -> tuple[str, str, str]:
    """A run and its task in a month of last year (its partitions made for it)."""
    today = now_utc().date()
    first = date(today.year - 1, today.month, 1)
    partitions.ensure_from(conn, first, 0)
    run_id = add_run(conn, at=datetime(first.year, first.month, 10, tzinfo=UTC))
    now = conn.execute("SELECT now()").fetchone()[0]
    task_id = f"{run_id[:8]}-a"
    tasks.insert_task(conn, run_id, task_id=task_id, node_id="a", node_type="TASK", queue="default",
                      state="RUNNING", now=now)
    conn.execute("UPDATE task_instances SET lease_owner = 'w', lease_expires_at = now() + interval '1 minute' "
                 "WHERE run_id = %s", (run_id,))
    return run_id, task_id, f"{first:%Y%m}"


@pytest.mark.parametrize("how", ["dropped", "detached"])
def test_a_month_gone_after_a_connection_checked_it_is_a_missing_run(db_url: str, how: str) -> None:
    """One connection locks a run of last year's month (the month is checked and
    remembered); another drops that month (or detaches it into composer_detached). The
    first's next lock finds the month's load function gone with it (Transient: the
    transaction runs again) and, checked again, the run missing (NotFound, as through the
    partitioned table); its heartbeat finds the lease lost, and once the month is made
    again its new runs are found: the connection checks the month again rather than
    trusting what it saw."""
    with TranslatingConnection.connect(db_url, autocommit=True) as other, TranslatingConnection.connect(db_url) as conn:
        add_definition(other)
        run_id, task_id, month = _last_year(other)
        row, loaded = runs.lock_and_load(conn, run_id)
        assert row.id == run_id and set(loaded) == {"a"}
        assert partitions.run_tables(conn, run_id) == (f"workflow_runs_p{month}", f"task_instances_p{month}")
        ref = TaskRef(run_id=run_id, task_id=task_id, node_id="a", attempt=0)
        assert tasks.heartbeat(conn, ref, "w", 30) is not None
        conn.commit()
        with other.transaction():
            archive.remove_month(other, month, partitions.RUN_TABLES, keep_table=how == "detached")
        with pytest.raises(Transient, match=run_id):
            runs.lock_and_load(conn, run_id)
        conn.rollback()
        with pytest.raises(NotFound, match=run_id):
            runs.lock_and_load(conn, run_id)
        conn.rollback()
        assert tasks.heartbeat(conn, ref, "w", 30) is None
        conn.rollback()
        again, _, _ = _last_year(other)
        assert runs.lock_and_load(conn, again)[0].id == again
        conn.rollback()
        assert partitions.run_tables(conn, again) == (f"workflow_runs_p{month}", f"task_instances_p{month}")


def test_the_month_check_is_per_connection(db_url: str) -> None:
    """What one connection found is not taken for another's (each checks once)."""
    with (TranslatingConnection.connect(db_url, autocommit=True) as a,
          TranslatingConnection.connect(db_url, autocommit=True) as b):
        add_definition(a)
        run_id = add_run(a)
        runs.lock_and_load(a, run_id)
        month = f"{now_utc():%Y%m}"
        own = partitions.RunTables(f"workflow_runs_p{month}", f"task_instances_p{month}",
                                   f"composer_load_run_p{month}")
        assert partitions._CHECKED.get(a) == {month: own}
        assert partitions._CHECKED.get(b) is None
        assert runs.lock_and_load(b, run_id)[0].id == run_id
        assert partitions._CHECKED.get(b) == {month: own}



def test_the_engine_role_names_the_partitions_it_was_granted_and_falls_back_without(db_url: str) -> None:
    """As composer_ops_engine: the partitions there were at migration and those
    its own upkeep creates (composer_ensure_partitions) may be named; one whose grant
    was revoked is reached through the partitioned tables, and the run is still found."""
    from tests.notebooks.harness import as_role

    engine_url = as_role(db_url, "composer_ops_engine")
    month = f"{now_utc():%Y%m}"
    with TranslatingConnection.connect(db_url, autocommit=True) as owner:
        add_definition(owner)
        run_id = add_run(owner)
    with TranslatingConnection.connect(engine_url) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("composer_ops_engine",)
        assert partitions.run_tables(conn, run_id) == (f"workflow_runs_p{month}", f"task_instances_p{month}")
        assert runs.lock_and_load(conn, run_id)[0].id == run_id
        conn.rollback()
        created: Any = conn.execute("SELECT composer_ensure_partitions(7)").fetchone()
        assert created[0] >= 4                                       # at least the 7th month ahead, four tables
        conn.commit()
        row: Any = conn.execute("""SELECT max(c.relname::text) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                                     WHERE i.inhparent = 'task_instances'::regclass""").fetchone()
        newest = row[0]
        assert conn.execute("SELECT has_table_privilege(%s, 'SELECT') AND has_table_privilege(%s, 'UPDATE')",
                            (newest, newest)).fetchone() == (True,)
        conn.rollback()
    with TranslatingConnection.connect(db_url, autocommit=True) as owner:
        owner.execute(f'REVOKE SELECT, UPDATE ON "task_instances_p{month}" FROM composer_ops_engine'.encode())
    with TranslatingConnection.connect(engine_url) as conn:
        assert partitions.run_tables(conn, run_id) == ("workflow_runs", "task_instances")
        locked, loaded = runs.lock_and_load(conn, run_id)
        assert locked.id == run_id and loaded == {}
        conn.rollback()


def _early_month(conn: Any, month: str, start: datetime, end: datetime) -> None:
    """``month``'s partitions of the run tables but run_history, bounded [start, end)."""
    for table in ("workflow_runs", "task_instances", "workflow_events"):
        conn.execute(sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES FROM (composer_uuid7_bound({})) "
                             "TO (composer_uuid7_bound({}))").format(
            sql.Identifier(f"{table}_p{month}"), sql.Identifier(table), sql.Literal(start), sql.Literal(end)))


def test_a_month_made_again_with_other_bounds_is_checked_again_when_a_run_is_not_in_it(db_url: str) -> None:
    """A connection found December 2024 aligned; the month is then dropped and made
    again an hour early, with January after it, so a run of 2024-12-31 23:30 UTC lives
    in January's partition. The connection looks for it with December's load function,
    dropped with the month (Transient: the transaction runs again), checks the month
    again, and finds it through the partitioned tables."""
    with TranslatingConnection.connect(db_url, autocommit=True) as other, TranslatingConnection.connect(db_url) as conn:
        add_definition(other)
        partitions.ensure_from(other, date(2024, 12, 1), 0)
        first = add_run(other, at=datetime(2024, 12, 10, tzinfo=UTC))
        assert runs.lock_and_load(conn, first)[0].id == first
        assert partitions.run_tables(conn, first) == ("workflow_runs_p202412", "task_instances_p202412")
        conn.commit()
        with other.transaction():
            archive.remove_month(other, "202412", partitions.RUN_TABLES, keep_table=False)
            hour_early = [datetime(2024, m, 1, tzinfo=UTC) - timedelta(hours=1) for m in (12,)]
            hour_early += [datetime(2025, m, 1, tzinfo=UTC) - timedelta(hours=1) for m in (1, 2)]
            _early_month(other, "202412", hour_early[0], hour_early[1])
            _early_month(other, "202501", hour_early[1], hour_early[2])
        late = uuid7_at(datetime(2024, 12, 31, 23, 30, tzinfo=UTC))
        other.execute("""INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, created_at,
                                                    updated_at)
                         VALUES (%s, 'wf', 1, 'RUNNING', now(), now())""", (late,))
        with pytest.raises(Transient, match=late):
            runs.lock_and_load(conn, late)
        conn.rollback()
        assert runs.lock_and_load(conn, late)[0].id == late
        assert partitions.run_tables(conn, late) == ("workflow_runs", "task_instances")
        conn.rollback()
