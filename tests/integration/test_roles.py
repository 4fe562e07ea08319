"""Least privilege (sql/V001, the grants of sql/R__*.sql): the engine runs whole workflows as composer_ops_engine,
including the coordinator's partition upkeep, yet cannot drop, detach or back-fill
partitions; the reader cannot write or call any partition function. Only the owner
drops. Sessions switch role at start-up (libpq ``options=-c role=...``), which is
what a login role that is a member of these roles gets by default."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, TaskContext, Worker
from composer_ops.db import connect
from composer_ops.db.migrate import migrate
from composer_ops.errors import PermissionDenied
from composer_ops.repo import simulator
from composer_ops.testing.processes import wait_for
from tests.notebooks.harness import as_role

ENGINE_ROLE = "composer_ops_engine"
READER_ROLE = "composer_ops_reader"


def _month() -> str:
    return datetime.now(UTC).strftime("%Y%m")


def refused(url: str, role: str, statements: list[str]) -> list[str]:
    """The statements ``role`` was allowed to run (each in its own transaction, rolled back)."""
    allowed = []
    with psycopg.connect(as_role(url, role)) as conn:
        assert conn.execute("SELECT current_user").fetchone() == (role,)
        for statement in statements:
            try:
                conn.execute(statement.encode())
            except psycopg.errors.InsufficientPrivilege:
                conn.rollback()
                continue
            conn.rollback()
            allowed.append(statement)
    return allowed


def engine_refusals() -> list[str]:
    m = _month()
    return [
        f"DROP TABLE workflow_events_p{m}",
        f"DROP TABLE task_instances_p{m}",
        f"ALTER TABLE workflow_runs DETACH PARTITION workflow_runs_p{m}",
        f"ALTER TABLE task_instances DETACH PARTITION task_instances_p{m}",
        "SELECT composer_drop_partitions(now() + interval '10 years')",
        "SELECT composer_ensure_partitions_from('2001-01-01', 0)",
        "SELECT composer_repair_partition_bounds()",
        "CREATE TABLE workflow_runs_p209901 PARTITION OF workflow_runs FOR VALUES FROM ('a') TO ('b')",
        "CREATE TABLE engine_was_here (x int)",
        "TRUNCATE task_outbox",
        "DELETE FROM workflow_runs",
        "DELETE FROM task_instances",
        "DELETE FROM workflow_definitions",
        "INSERT INTO schema_migrations (version, name, checksum) VALUES (999, 'x', 'x')",
        "ALTER TABLE task_instances ADD COLUMN x int",
        "DROP FUNCTION composer_drop_partitions(timestamptz)",
        "CREATE OR REPLACE FUNCTION composer_ensure_partitions(months_ahead INT DEFAULT 3) RETURNS INT "
        "LANGUAGE sql AS 'SELECT 0'",
    ]


def reader_refusals() -> list[str]:
    m = _month()
    return [
        "SELECT composer_ensure_partitions(3)",
        "SELECT composer_ensure_partitions_from('2031-01-01', 0)",
        "SELECT composer_drop_partitions(now() + interval '10 years')",
        "SELECT composer_repair_partition_bounds()",
        "INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s) VALUES ('q','r','t',0,'n',1)",
        "UPDATE task_instances SET lease_expires_at = now()",
        "DELETE FROM webhook_deliveries",
        f"DROP TABLE workflow_events_p{m}",
        f"ALTER TABLE workflow_runs DETACH PARTITION workflow_runs_p{m}",
    ]


def test_the_engine_role_cannot_drop_detach_or_backfill_partitions(db_url: str) -> None:
    assert refused(db_url, ENGINE_ROLE, engine_refusals()) == []


def test_the_reader_cannot_write_or_call_partition_functions(db_url: str) -> None:
    assert refused(db_url, READER_ROLE, reader_refusals()) == []


def test_the_roles_cannot_log_in_and_have_no_special_powers(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("""SELECT rolname, rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, rolbypassrls
                                 FROM pg_roles WHERE rolname = ANY(%s) ORDER BY rolname""",
                            ([ENGINE_ROLE, READER_ROLE],)).fetchall()
    assert rows == [(ENGINE_ROLE, False, False, False, False, False), (READER_ROLE, False, False, False, False, False)]


@pytest.fixture
def engine_as_role(db_url: str) -> Iterator[Engine]:
    with Engine.connect(as_role(db_url, ENGINE_ROLE), pool_size=3) as engine:
        yield engine


def test_a_whole_workflow_runs_as_the_engine_role(engine_as_role: Engine, db_url: str) -> None:
    engine = engine_as_role
    engine.deploy({"id": "roles", "webhook_url": "http://127.0.0.1:9/unused", "nodes": [
        {"id": "a", "type": "TASK", "task": "t"},
        {"id": "ask", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["a"]},
        {"id": "b", "type": "TASK", "task": "t", "depends_on": ["ask"]}]})
    run_id = engine.start("roles", input={"x": 1})
    engine.signal(run_id, "go", {"early": True})                  # buffered: workflow_events
    cancelled = engine.start("roles")
    engine.cancel(cancelled, reason="not needed")
    worker = Worker(engine, concurrency=2, poll_interval=0.1)

    @worker.handler("t")
    def t(input: Any, ctx: TaskContext) -> dict[str, Any]:
        return {"node": ctx.node_id}

    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: engine.get_run(run_id).status == "SUCCEEDED", timeout=60, what="the run")
    finally:
        worker.stop()
        thread.join(60)
    stats = engine.coordinator(relay=None).run_once()               # upkeep, timers, leases, webhooks
    assert stats.errors == []
    with psycopg.connect(db_url) as owner:
        row: Any = owner.execute("SELECT count(*), count(*) FILTER (WHERE attempts = 1) FROM webhook_deliveries"
                                 ).fetchone()
    assert row == (2, 2)                                           # both runs' deliveries were attempted


def test_partition_upkeep_as_the_engine_role_creates_owner_owned_partitions(db_url: str) -> None:
    with psycopg.connect(as_role(db_url, ENGINE_ROLE), autocommit=True) as conn:
        created = conn.execute("SELECT composer_ensure_partitions(6)").fetchone()
        assert created == (12,)                                      # months 4..6 ahead, four tables each
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="between 0 and 120"):
            conn.execute("SELECT composer_ensure_partitions(100000)")
        # A temporary table cannot hijack the definer's lookups (pg_temp comes last).
        conn.execute("CREATE TEMP TABLE workflow_runs (id text)")
        assert conn.execute("SELECT composer_ensure_partitions(7)").fetchone() == (4,)
        row: Any = conn.execute("""SELECT max(c.relname::text) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                                     WHERE i.inhparent = 'public.workflow_runs'::regclass""").fetchone()
        newest = row[0]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(f"DROP TABLE {newest}".encode())
    with psycopg.connect(db_url) as owner:
        owners = owner.execute("""SELECT DISTINCT pg_get_userbyid(c.relowner) FROM pg_inherits i
                                    JOIN pg_class c ON c.oid = i.inhrelid""").fetchall()
        config = owner.execute("""SELECT prosecdef, proconfig FROM pg_proc
                                   WHERE proname = 'composer_ensure_partitions'""").fetchone()
    assert owners == [(owner_name(db_url),)]
    assert config == (True, ["search_path=public, pg_temp"])
    assert refused(db_url, READER_ROLE, [f"SELECT count(*) FROM {newest}"]) == [f"SELECT count(*) FROM {newest}"]


def owner_name(url: str) -> str:
    with psycopg.connect(url) as conn:
        return str(conn.execute("SELECT current_user").fetchone()[0])  # type: ignore[index]


def test_migrating_another_database_reuses_the_roles(empty_db_url: str) -> None:
    migrate(empty_db_url)                                 # the roles exist already: no error
    assert refused(empty_db_url, ENGINE_ROLE, ["SELECT composer_drop_partitions(now())"]) == []
    with psycopg.connect(as_role(empty_db_url, ENGINE_ROLE)) as conn:
        assert conn.execute("SELECT composer_ensure_partitions(3)").fetchone() == (0,)


def test_a_missing_privilege_is_permission_denied_and_the_backfill_checks_rows_one_by_one(db_url: str) -> None:
    with connect(as_role(db_url, ENGINE_ROLE)) as conn:
        with pytest.raises(PermissionDenied, match="session_replication_role"):
            conn.execute("SET session_replication_role = replica")
        conn.rollback()
        assert simulator.may_skip_row_triggers(conn) is False
    with connect(db_url) as conn:
        assert simulator.may_skip_row_triggers(conn) is True


@pytest.mark.parametrize("argv", [
    ["partitions", "archive", "--older-than", "1d", "--to", "{dir}"],
    ["partitions", "drop", "--older-than", "1d", "--archive", "{dir}", "--yes"],
    ["partitions", "detach", "--older-than", "1d", "--yes"],
], ids=["archive", "drop", "detach"])
def test_the_partition_actions_refuse_a_role_that_is_not_the_owner_naming_the_owner(
        db_url: str, argv: list[str], tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """As the engine role, archive failed on `permission denied for table schema_migrations`
    and the audit's refusal advised the engine role itself: each is refused at once, in one
    line naming the owner, nothing written."""
    from composer_ops.cli import main

    args = [a.replace("{dir}", str(tmp_path / "arch")) for a in argv]
    assert main([*args, "--database-url", as_role(db_url, ENGINE_ROLE)]) == 1
    err = capsys.readouterr().err
    assert f"role {ENGINE_ROLE} is not the schema's owner" in err, err
    assert f"run it as the owner, {owner_name(db_url)}, " in err, err         # named: who to run it as
    arch = tmp_path / "arch"
    assert err.count("\n") == 1 and not (arch.exists() and any(arch.iterdir())), err     # no file written


@pytest.mark.parametrize(("role", "argv", "needs"), [
    (ENGINE_ROLE, ["partitions", "drop", "--older-than", "1d", "--yes"], "is not the schema's owner"),
    (READER_ROLE, ["partitions", "drop", "--older-than", "1d", "--yes"], "is not the schema's owner"),
    (ENGINE_ROLE, ["migrate"], "is not the schema's owner"),
    (READER_ROLE, ["partitions", "ensure", "--months-ahead", "3"], f"run it as the engine role ({ENGINE_ROLE})"),
    (READER_ROLE, ["runs", "cancel", "--workflow", "wf", "--yes"], "may not write the operator audit"),
    (ENGINE_ROLE, ["simulate", "--no-live", "--history-months", "2", "--runs-per-month", "5"],
     "is not the schema's owner"),
], ids=["drop-engine", "drop-reader", "migrate-engine", "ensure-reader", "cancel-reader", "simulate-engine"])
def test_a_command_the_role_may_not_take_names_the_role_it_needs(
        db_url: str, role: str, argv: list[str], needs: str, capsys: pytest.CaptureFixture[str]) -> None:
    """These failed on the server's bare `permission denied for table ...` (simulate after
    deploying its definitions): each is refused first, in the one line the other
    operator commands print, naming the role, with nothing changed."""
    from composer_ops.cli import main

    with psycopg.connect(db_url) as conn:
        before = conn.execute("""SELECT (SELECT count(*) FROM workflow_definitions), (SELECT count(*) FROM pg_class),
                                        (SELECT count(*) FROM operator_audit)""").fetchone()
    assert main([*argv, "--database-url", as_role(db_url, role)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"role {role} " in err and needs in err, err
    assert "permission denied for" not in err, err
    with psycopg.connect(db_url) as conn:
        after = conn.execute("""SELECT (SELECT count(*) FROM workflow_definitions), (SELECT count(*) FROM pg_class),
                                       (SELECT count(*) FROM operator_audit)""").fetchone()
    assert after == before


@pytest.mark.parametrize("once", [True, False], ids=["once", "loop"])
def test_a_coordinator_with_retention_is_refused_at_start_unless_it_is_the_owner(
        db_url: str, once: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """As the engine role, `coordinator --retention` started, then logged `permission denied
    for table retention_drops` every pass, for ever: it is refused before it starts."""
    from composer_ops.cli import main

    argv = ["coordinator", "--retention", "5 months", "--database-url", as_role(db_url, ENGINE_ROLE)]
    assert main([*argv, "--once"] if once else argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "coordinator --retention: role composer_ops_engine is not the schema's " \
                                    "owner" in err, err
    with Engine.connect(as_role(db_url, ENGINE_ROLE), pool_size=1) as engine:
        with pytest.raises(PermissionDenied, match="is not the schema's owner"):
            engine.coordinator(retention="5 months")
        engine.coordinator()                           # without retention the engine role is enough
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.coordinator(retention="5 months")       # the owner


@pytest.mark.parametrize("argv", [
    ["start", "wf"],
    ["signal", "{run}", "go"],
    ["cancel", "{run}"],
    ["runs", "retry", "{run}", "--yes"],
    ["runs", "delete", "{run}", "--yes"],
], ids=["start", "signal", "cancel", "retry", "delete"])
def test_a_change_refused_to_the_reader_names_the_role_it_needs(
        db_url: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The commands that do not check the role first were refused with the server's bare
    `permission denied for table ...`: the one line says which role would do, and nothing changed."""
    from composer_ops.cli import main

    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy({"id": "wf", "nodes": [{"id": "w", "type": "WAIT_FOR_SIGNAL", "signal": "go"}]})
        run_id = engine.start("wf")
    with psycopg.connect(db_url) as conn:
        before = conn.execute("SELECT (SELECT count(*) FROM workflow_runs), (SELECT count(*) FROM run_history), "
                              "(SELECT count(*) FROM operator_audit)").fetchone()
    code = main([*(a.replace("{run}", run_id) for a in argv), "--database-url", as_role(db_url, READER_ROLE)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, (code, err)
    assert "permission denied" in err and f"engine role {ENGINE_ROLE}" in err, err
    with psycopg.connect(db_url) as conn:
        after = conn.execute("SELECT (SELECT count(*) FROM workflow_runs), (SELECT count(*) FROM run_history), "
                             "(SELECT count(*) FROM operator_audit)").fetchone()
    assert after == before
