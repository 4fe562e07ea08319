"""The migration runner and the schema it builds: a fresh install equals every release in
turn, repeatable files are applied again when they change, applied V files never are,
a pre-release database is refused, concurrency, checksums, the Citus series."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from composer_ops.db.migrate import PRE_RELEASE, Migration, discover, discover_repeatable, migrate, status
from composer_ops.errors import ComposerError, Invalid
from composer_ops.testing.servers import Server
from tests.integration.catalog import differences, snapshot
from tests.integration.helpers import at_once, uuid7_at


@pytest.fixture
def fresh_url(server: Server) -> Iterator[str]:
    """A database migrated in one go, as a fresh install is (not a clone of the
    template: CREATE DATABASE ... TEMPLATE does not copy the database's own grants)."""
    with server.database() as url:
        migrate(url)
        yield url


def _forget_repeatable(url: str) -> None:
    """As if every repeatable file had changed since it was applied (a release that
    edits only functions): the next migrate applies them all again."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM schema_migrations WHERE version IS NULL")


def test_a_fresh_install_equals_every_release_applied_in_turn(empty_db_url: str, fresh_url: str) -> None:
    """fresh_url was migrated in one go. Here each V file is applied on its
    own with the repeatable files after it, then the repeatable files once more, as a
    later release that changes only functions would: the catalogs must be equal."""
    for mig in discover():
        applied = migrate(empty_db_url, target=mig.version)
        assert [a.filename for a in applied] == [mig.filename] + [r.filename for r in discover_repeatable()]
        _forget_repeatable(empty_db_url)
        again = migrate(empty_db_url, target=mig.version)
        assert [a.filename for a in again] == [r.filename for r in discover_repeatable()]
    assert differences(snapshot(empty_db_url), snapshot(fresh_url)) == {}


def test_v006_gives_the_waits_of_0_1_0_the_signal_names(empty_db_url: str) -> None:
    """A waiting task as 0.1.0 wrote it (the old spellings of its node type and column)
    reads as a WAIT_FOR_SIGNAL task with its signal_name after V006."""
    old_type, old_column = "WAIT_FOR_EVENT", "event_name"   # the old spelling
    migrate(empty_db_url, target=1)
    run_id = uuid7_at(datetime.now(UTC))
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute("""INSERT INTO workflow_definitions (id, name, version, spec_json, created_by)
                        VALUES ('old', 'old', 1, '{}', 'test')""")
        conn.execute("INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version) VALUES (%s, 'old', 1)",
                     (run_id,))
        conn.execute(sql.SQL("""INSERT INTO task_instances (id, run_id, node_id, node_type, state, {})
                                VALUES (%s, %s, 'w', %s, 'WAITING', 'go'), (%s, %s, 'a', 'TASK', 'PENDING', NULL)
                             """).format(sql.Identifier(old_column)),
                     (uuid7_at(datetime.now(UTC)), run_id, old_type, uuid7_at(datetime.now(UTC)), run_id))
    assert "V006__signal_names.sql" in [a.filename for a in migrate(empty_db_url)]
    with psycopg.connect(empty_db_url) as conn:
        rows = conn.execute("SELECT node_id, node_type, signal_name FROM task_instances ORDER BY node_id").fetchall()
    assert rows == [("a", "TASK", None), ("w", "WAIT_FOR_SIGNAL", "go")]


_RUN_KEYS = """SELECT c.conrelid::regclass::text, c.confrelid::regclass::text
                 FROM pg_constraint c JOIN pg_class r ON r.oid = c.conrelid
                WHERE c.contype = 'f' AND c.confrelid::regclass::text LIKE 'workflow_runs%%'
                  AND (r.relname LIKE 'task_instances%%' OR r.relname LIKE 'workflow_events%%')"""


def test_v011_drops_the_task_to_run_key_on_every_month_and_new_months_have_none(empty_db_url: str) -> None:
    """The tasks' key to their run goes from the parent and every month partition, the
    rows stay; a month made afterwards has none either; workflow_events keeps its key."""
    migrate(empty_db_url, target=9)
    run_id = uuid7_at(datetime.now(UTC))
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        before = conn.execute(_RUN_KEYS).fetchall()
        assert any(t.startswith("task_instances") for t, _ in before)
        conn.execute("""INSERT INTO workflow_definitions (id, name, version, spec_json, created_by)
                        VALUES ('d', 'd', 1, '{}', 'test')""")
        conn.execute("INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version) VALUES (%s, 'd', 1)",
                     (run_id,))
        conn.execute("INSERT INTO task_instances (id, run_id, node_id, node_type) VALUES (%s, %s, 'a', 'TASK')",
                     (uuid7_at(datetime.now(UTC)), run_id))
    assert "V011__tasks_without_run_fk.sql" in [a.filename for a in migrate(empty_db_url)]
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        after = conn.execute(_RUN_KEYS).fetchall()
        assert after and all(t.startswith("workflow_events") for t, _ in after)
        assert {t for t, _ in after} == {t.replace("task_instances", "workflow_events") for t, _ in before
                                         if t.startswith("task_instances")}
        assert conn.execute("SELECT count(*) FROM task_instances WHERE run_id = %s", (run_id,)).fetchone() == (1,)
        conn.execute("SELECT composer_ensure_partitions_from('2031-01-01', 0)")
        assert conn.execute(_RUN_KEYS + " AND r.relname LIKE '%%_p203101'").fetchall() == [
            ("workflow_events_p203101", "workflow_runs")]


_DEFINITION_KEYS = """SELECT c.conrelid::regclass::text FROM pg_constraint c
                        WHERE c.contype = 'f' AND c.confrelid = 'workflow_definitions'::regclass ORDER BY 1"""


def test_v019_drops_the_run_to_definition_key_on_every_month_and_new_months_have_none(empty_db_url: str) -> None:
    """The runs' key to their definition goes from the parent and every month partition,
    the rows stay; a month made afterwards has none either."""
    migrate(empty_db_url, target=18)
    run_id = uuid7_at(datetime.now(UTC))
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        before = [t for (t,) in conn.execute(_DEFINITION_KEYS).fetchall()]
        assert "workflow_runs" in before and any(t.startswith("workflow_runs_p") for t in before), before
        conn.execute("""INSERT INTO workflow_definitions (id, name, version, spec_json, created_by)
                        VALUES ('d', 'd', 1, '{}', 'test')""")
        conn.execute("INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version) VALUES (%s, 'd', 1)",
                     (run_id,))
    assert "V019__runs_without_definition_fk.sql" in [a.filename for a in migrate(empty_db_url)]
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute("SELECT composer_ensure_partitions_from('2031-01-01', 0)")
        assert conn.execute(_DEFINITION_KEYS).fetchall() == []
        assert conn.execute("SELECT workflow_definition_id FROM workflow_runs WHERE id = %s",
                            (run_id,)).fetchall() == [("d",)]


def test_migrate_from_empty_equals_applying_the_files_by_hand(empty_db_url: str, fresh_url: str) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        for script in [*discover(), *discover_repeatable()]:
            with conn.transaction():
                conn.execute(script.path.read_text())
    assert differences(snapshot(empty_db_url), snapshot(fresh_url)) == {}


def test_migrate_is_idempotent_and_reports_status(db_url: str) -> None:
    assert migrate(db_url) == []
    assert all(state == "applied" for _, state in status(db_url))
    assert [s.filename for s, _ in status(db_url)] == [s.filename for s in [*discover(), *discover_repeatable()]]


def test_two_migrators_at_once_one_waits_neither_fails(empty_db_url: str) -> None:
    def run(go: Callable[[], None]) -> int:
        go()
        return len(migrate(empty_db_url))

    assert sorted(at_once(run)) == [0, len(discover()) + len(discover_repeatable())]


def _copy_migrations(target: Path) -> Path:
    """The plain series (V and R files) in a directory of its own."""
    target.mkdir()
    for script in [*discover(), *discover_repeatable()]:
        (target / script.filename).write_bytes(script.path.read_bytes())
    return target


def test_an_edited_applied_file_is_refused(empty_db_url: str, tmp_path: Path) -> None:
    sql_dir = _copy_migrations(tmp_path / "sql")
    migrate(empty_db_url, sql_dir=sql_dir)
    first = sorted(sql_dir.glob("V001__*.sql"))[0]
    first.write_text(first.read_text() + "\n-- an innocent-looking edit\n")
    with pytest.raises(Invalid, match="V001__init.sql was changed after it was applied"):
        migrate(empty_db_url, sql_dir=sql_dir)
    # `migrate --status`, the upgrade's first step, says so before migrate is tried
    states = {script.filename: state for script, state in status(empty_db_url, sql_dir=sql_dir)}
    assert states[first.name] == "changed" and {s for f, s in states.items() if f != first.name} == {"applied"}


def test_migrate_status_exits_2_naming_a_file_edited_after_it_was_applied(
        empty_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from composer_ops.cli import main
    from composer_ops.db import migrate as migrate_module

    sql_dir = _copy_migrations(tmp_path / "sql")
    migrate(empty_db_url, sql_dir=sql_dir)
    first = sorted(sql_dir.glob("V001__*.sql"))[0]
    first.write_text(first.read_text() + "\n-- an innocent-looking edit\n")
    monkeypatch.setattr(migrate_module, "SQL_DIR", sql_dir)
    monkeypatch.setattr(migrate_module.status, "__kwdefaults__", {"sql_dir": sql_dir})
    assert main(["migrate", "--status", "--database-url", empty_db_url]) == 2
    out, err = capsys.readouterr()
    assert f"changed  {first.name}" in out and "pending" not in out, out
    assert err.count("\n") == 1 and f"{first.name} changed after it was applied" in err, err


def _body(url: str, function: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", (function,)).fetchone()
    assert row is not None
    return str(row[0])


def test_an_edited_repeatable_file_is_applied_again_and_the_catalogs_tell(
        empty_db_url: str, fresh_url: str, tmp_path: Path) -> None:
    sql_dir = _copy_migrations(tmp_path / "sql")
    migrate(empty_db_url, sql_dir=sql_dir)
    assert differences(snapshot(empty_db_url), snapshot(fresh_url)) == {}
    retry = sql_dir / "R__retry.sql"
    retry.write_text(retry.read_text().replace("RETURN removed;", "RETURN removed;  -- edited"))
    assert [s.filename for s in migrate(empty_db_url, sql_dir=sql_dir)] == [
        r.filename for r in discover_repeatable(sql_dir)]
    assert "RETURN removed;  -- edited" in _body(empty_db_url, "composer_reset_tasks")
    assert migrate(empty_db_url, sql_dir=sql_dir) == []
    assert all(state == "applied" for _, state in status(empty_db_url, sql_dir=sql_dir))
    # The snapshot compares whole function definitions: one edited line is a difference.
    diff = differences(snapshot(empty_db_url), snapshot(fresh_url))
    assert list(diff) == ["function"]
    assert ["-- edited" in f for f in diff["function"]["only in the first"]] == [True]


def test_a_database_of_the_pre_release_migrations_is_refused_and_left_alone(
        empty_db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The runner before the squash recorded V001..V020 in a table without `script`."""
    from composer_ops.cli import main

    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute("""CREATE TABLE schema_migrations(version INT PRIMARY KEY, name TEXT NOT NULL,
                          checksum TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())""")
        conn.execute("""INSERT INTO schema_migrations (version, name, checksum)
                        SELECT v, 'pre_release_' || v, md5(v::text) FROM generate_series(1, 20) v
                         WHERE v NOT IN (7, 14, 16)""")
    before = snapshot(empty_db_url)
    with pytest.raises(Invalid, match="created by a pre-release schema"):
        migrate(empty_db_url)
    assert main(["migrate", "--database-url", empty_db_url]) == 2
    err = capsys.readouterr().err
    assert PRE_RELEASE in err and len(err.strip().splitlines()) == 1
    with pytest.raises(Invalid, match="created by a pre-release schema"):
        status(empty_db_url)
    assert differences(snapshot(empty_db_url), before) == {}
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute("SELECT count(*) FROM schema_migrations").fetchone() == (17,)


def test_a_failing_migration_rolls_back_and_is_not_recorded(empty_db_url: str, tmp_path: Path) -> None:
    sql_dir = _copy_migrations(tmp_path / "sql")
    (sql_dir / "V999__broken.sql").write_text("CREATE TABLE half_done(x int);\nSELECT 1/0;\n")
    with pytest.raises(ComposerError, match="V999__broken.sql failed: division by zero"):
        migrate(empty_db_url, sql_dir=sql_dir)
    with psycopg.connect(empty_db_url) as conn:
        half_done = conn.execute("SELECT to_regclass('half_done')").fetchone()
        assert half_done is not None
        assert half_done[0] is None
        versions: Any = conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
        assert versions[0] == max(m.version for m in discover())


def test_badly_named_migration_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "V1_oops.sql").write_text("SELECT 1")
    with pytest.raises(Invalid, match="named V<NNN>__<snake_case>.sql"):
        discover(tmp_path)


def _series(tmp_path: Path, citus_files: dict[str, str]) -> Path:
    sql_dir = _copy_migrations(tmp_path / "sql")
    (sql_dir / "citus").mkdir()
    for name, body in citus_files.items():
        (sql_dir / "citus" / name).write_text(body)
    return sql_dir


def test_citus_only_migrations_are_skipped_on_a_single_server_and_later_versions_still_apply(
        empty_db_url: str, tmp_path: Path) -> None:
    last = max(m.version for m in discover())
    sql_dir = _series(tmp_path, {f"V{last + 1:03d}__distribute.sql": "SELECT create_distributed_table('x', 'y');\n"})
    (sql_dir / f"V{last + 2:03d}__after.sql").write_text("CREATE TABLE after_citus(x int);\n")
    applied = [m.version for m in migrate(empty_db_url, sql_dir=sql_dir) if isinstance(m, Migration)]
    assert applied[-1] == last + 2
    assert last + 1 not in applied
    assert migrate(empty_db_url, sql_dir=sql_dir) == []
    assert [m.citus for m in discover(sql_dir, citus=True) if m.version == last + 1] == [True]
    assert [m.version for m, _ in status(empty_db_url, sql_dir=sql_dir) if isinstance(m, Migration)][-1] == last + 2


def test_a_citus_file_replaces_the_plain_file_of_its_version_in_the_citus_series(tmp_path: Path) -> None:
    sql_dir = _series(tmp_path, {"V001__init.sql": "SELECT 'citus variant';\n"})
    plain = {m.version: m for m in discover(sql_dir)}
    on_citus = {m.version: m for m in discover(sql_dir, citus=True)}
    assert on_citus.keys() == plain.keys()
    assert on_citus[1].citus and on_citus[1].path == sql_dir / "citus" / "V001__init.sql"
    assert [v for v in plain if on_citus[v].checksum != plain[v].checksum] == [1]


def test_citus_repeatable_files_replace_theirs_by_name_and_the_citus_only_ones_run_last(tmp_path: Path) -> None:
    sql_dir = _series(tmp_path, {"R__claim.sql": "SELECT 'citus claim';\n", "R__aaa.sql": "SELECT 'last';\n"})
    plain = discover_repeatable(sql_dir)
    on_citus = discover_repeatable(sql_dir, citus=True)
    assert [r.name for r in on_citus] == [r.name for r in plain] + ["aaa"]
    assert [(r.name, r.key) for r in on_citus if r.citus] == [("claim", "citus/R__claim.sql"),
                                                              ("aaa", "citus/R__aaa.sql")]
    assert [r.key for r in discover_repeatable()] == [r.filename for r in discover_repeatable()]
    assert {r.key for r in discover_repeatable(citus=True) if r.citus} == {
        "citus/R__child_deliveries.sql", "citus/R__claim_node.sql", "citus/R__dispatch.sql",
        "citus/R__node_local.sql", "citus/R__partition_stats.sql", "citus/R__scan_node.sql"}


def test_migrate_citus_on_a_database_without_the_extension_is_refused_and_changes_nothing(
        empty_db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from composer_ops.cli import main

    with pytest.raises(Invalid, match="--citus: this database has no citus extension"):
        migrate(empty_db_url, citus=True)
    assert main(["migrate", "--citus", "--database-url", empty_db_url]) == 2
    assert "no citus extension" in capsys.readouterr().err
    with psycopg.connect(empty_db_url) as conn:
        row = conn.execute("SELECT to_regclass('workflow_runs')").fetchone()
        assert row is not None and row[0] is None


def test_a_plain_file_numbered_like_a_citus_only_file_is_refused_in_both_modes(tmp_path: Path) -> None:
    last = max(m.version for m in discover())
    sql_dir = _series(tmp_path, {f"V{last + 1:03d}__distribute.sql": "SELECT 1;\n"})
    (sql_dir / f"V{last + 1:03d}__something_else.sql").write_text("SELECT 2;\n")
    for citus in (False, True):
        with pytest.raises(Invalid, match=f"share version {last + 1}; a file in sql/citus/ replaces"):
            discover(sql_dir, citus=citus)


def test_a_migration_behind_a_long_reader_gives_up_within_its_lock_timeout(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A pending ALTER queued behind a reader's open transaction held every later statement
    on the table (the engine's starts) for as long as the reader lasted. Each try waits
    lock_timeout_s, then backs off; after the attempts it is refused naming the holder,
    applying nothing, and meanwhile other sessions' statements on the table go through."""
    import threading
    import time

    with psycopg.connect(db_url, autocommit=True) as conn:       # V018 pending again (it is idempotent)
        conn.execute("DELETE FROM schema_migrations WHERE script LIKE 'V018%'")
    reader = psycopg.connect(db_url, application_name="oncall-psql")
    reader.execute("SELECT count(*) FROM task_outbox")           # in a transaction: ACCESS SHARE held
    try:
        waited: list[float] = []
        stop = threading.Event()

        def engine_reads() -> None:
            with psycopg.connect(db_url, autocommit=True) as other:
                while not stop.is_set():
                    t0 = time.monotonic()
                    other.execute("SELECT count(*) FROM task_outbox")
                    waited.append(time.monotonic() - t0)
                    time.sleep(0.02)

        traffic = threading.Thread(target=engine_reads)
        traffic.start()
        started = time.monotonic()
        try:
            with pytest.raises(ComposerError) as refused:
                migrate(db_url, lock_timeout_s=0.3, attempts=3)
        finally:
            stop.set()
            traffic.join(30)
        took = time.monotonic() - started
        text = str(refused.value)
        assert "V018__outbox_handed_to.sql: could not take its locks within 0.3s in 3 attempts" in text, text
        assert f"pid {reader.info.backend_pid} (" in text and "oncall-psql" in text and "task_outbox" in text, text
        assert took < 10.0, took                                   # 3 x 0.3 s plus backoff under 0.75 s
        assert waited and max(waited) < 2.0, max(waited)           # never queued longer than a try
        assert len([r for r in caplog.records if "a lock was busy" in r.getMessage()]) == 2
        with psycopg.connect(db_url) as conn:
            assert conn.execute("SELECT count(*) FROM schema_migrations WHERE script LIKE 'V018%'").fetchone() == (0,)
    finally:
        reader.close()
    assert [m.filename for m in migrate(db_url, lock_timeout_s=0.3)][0] == "V018__outbox_handed_to.sql"


@pytest.mark.parametrize(("kw", "match"), [({"lock_timeout_s": 0}, "lock timeout"), ({"attempts": 0}, "attempts")])
def test_bad_lock_options_are_invalid(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(Invalid, match=match):
        migrate("postgresql://nobody@/nowhere?host=/nonexistent", **kw)
