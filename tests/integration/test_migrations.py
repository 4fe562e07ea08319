"""The migration runner: canonical schema, concurrency, checksums."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from composer_ops.db.migrate import discover, migrate, status
from composer_ops.errors import ComposerError, Invalid
from tests.integration.helpers import at_once

SCHEMA_QUERY = """
SELECT 'column', table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable
       || ' ' || COALESCE(column_default, '') || ' ' || COALESCE(collation_name, '')
  FROM information_schema.columns WHERE table_schema = 'public'
UNION ALL
SELECT 'index', indexname || ' ' || indexdef FROM pg_indexes WHERE schemaname = 'public'
UNION ALL
SELECT 'function', p.proname || ' ' || md5(pg_get_functiondef(p.oid))
  FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public'
UNION ALL
SELECT 'partition', c.relname || ' ' || pg_get_expr(c.relpartbound, c.oid)
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'public' AND c.relispartition AND c.relkind IN ('r', 'p')
UNION ALL
SELECT 'constraint', conrelid::regclass::text || ' ' || pg_get_constraintdef(oid)
  FROM pg_constraint WHERE connamespace = 'public'::regnamespace AND conrelid <> 0
ORDER BY 1, 2
"""


def schema(url: str) -> list[tuple[str, str]]:
    with psycopg.connect(url) as conn:
        return [(k, v) for k, v in conn.execute(SCHEMA_QUERY).fetchall() if "schema_migrations" not in v]


def test_migrate_from_empty_equals_applying_the_files_by_hand(empty_db_url: str, db_url: str) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        for mig in discover():
            with conn.transaction():
                conn.execute(mig.path.read_text())
    assert schema(empty_db_url) == schema(db_url)


def test_migrate_is_idempotent_and_reports_status(db_url: str) -> None:
    assert migrate(db_url) == []
    assert all(applied for _, applied in status(db_url))


def test_two_migrators_at_once_one_waits_neither_fails(empty_db_url: str) -> None:
    def run(go: Callable[[], None]) -> int:
        go()
        return len(migrate(empty_db_url))

    assert sorted(at_once(run)) == [0, len(discover())]


def _copy_migrations(target: Path) -> Path:
    target.mkdir()
    for mig in discover():
        (target / mig.filename).write_bytes(mig.path.read_bytes())
    return target


def test_an_edited_applied_file_is_refused(empty_db_url: str, tmp_path: Path) -> None:
    sql_dir = _copy_migrations(tmp_path / "sql")
    migrate(empty_db_url, sql_dir=sql_dir)
    first = sorted(sql_dir.glob("V001__*.sql"))[0]
    first.write_text(first.read_text() + "\n-- an innocent-looking edit\n")
    with pytest.raises(Invalid, match="V001__init.sql was changed after it was applied"):
        migrate(empty_db_url, sql_dir=sql_dir)


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
    applied = migrate(empty_db_url, sql_dir=sql_dir)
    assert [m.version for m in applied][-1] == last + 2
    assert last + 1 not in [m.version for m in applied]
    assert migrate(empty_db_url, sql_dir=sql_dir) == []
    assert [m.citus for m in discover(sql_dir, citus=True) if m.version == last + 1] == [True]
    assert [m.version for m, _ in status(empty_db_url, sql_dir=sql_dir)][-1] == last + 2


def test_a_citus_file_replaces_the_plain_file_of_its_version_in_the_citus_series(tmp_path: Path) -> None:
    sql_dir = _series(tmp_path, {"V002__utc_partition_arithmetic.sql": "SELECT 'citus variant';\n"})
    plain = {m.version: m for m in discover(sql_dir)}
    on_citus = {m.version: m for m in discover(sql_dir, citus=True)}
    assert on_citus.keys() == plain.keys()
    assert on_citus[2].citus and on_citus[2].path == sql_dir / "citus" / "V002__utc_partition_arithmetic.sql"
    assert [v for v in plain if on_citus[v].checksum != plain[v].checksum] == [2]


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


def test_the_outbox_has_no_shard_column_and_dispatch_works_without_it(empty_db_url: str) -> None:
    """V008 drops the column nothing read; an outbox migrated only up to V006 still
    takes the engine's inserts (the column's default fills it), so code can be
    deployed before the migration."""
    migrate(empty_db_url, target=6)
    insert = """INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s)
                VALUES ('q', 'r', %s, 0, 'n', 1)"""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(insert, ("t1",))
        assert conn.execute("SELECT shard FROM task_outbox").fetchall() == [(0,)]
    migrate(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        columns = [r[0] for r in conn.execute("""SELECT column_name FROM information_schema.columns
                                                  WHERE table_name = 'task_outbox'""")]
        assert "shard" not in columns and "queue" in columns
        conn.execute(insert, ("t2",))
        assert conn.execute("SELECT task_id FROM task_outbox ORDER BY id").fetchall() == [("t1",), ("t2",)]
