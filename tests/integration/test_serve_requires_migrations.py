"""A worker or coordinator refuses, at start, a database without its version's migrations.

Started against an empty database (a forgotten COMPOSER_DATABASE_URL) or one whose
upgrade skipped `migrate`, a worker logged "claim failed" for ever and looked alive: now
one line, exit 1, before anything is served."""

from __future__ import annotations

import time

import psycopg
import pytest

from composer_ops.cli import main
from composer_ops.db.roles import ENGINE_ROLE
from tests.notebooks.harness import as_role

APP = "examples.order_worker:make_worker"


def _serve(kind: str, url: str) -> list[str]:
    return (["worker", "--app", APP, "--database-url", url] if kind == "worker"
            else ["coordinator", "--once", "--database-url", url])


@pytest.mark.parametrize("kind", ["worker", "coordinator"])
def test_an_empty_database_is_refused_in_one_line(kind: str, empty_db_url: str,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    assert main(_serve(kind, empty_db_url)) == 1
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err
    assert "this database is not migrated for composer_ops " in err and \
        "no composer_ops schema is installed here; run `composer-ops migrate`" in err, err


@pytest.mark.parametrize("kind", ["worker", "coordinator"])
def test_a_pending_migration_is_named(kind: str, db_url: str, capfd: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute("DELETE FROM schema_migrations WHERE script = 'V020__audit_columns_engine_writes.sql'")
    assert main(_serve(kind, db_url)) == 1
    err = capfd.readouterr().err
    assert "V020__audit_columns_engine_writes.sql pending; run `composer-ops migrate`" in err, err


def test_the_engine_role_reads_what_is_applied_and_is_refused_without_v021(
        db_url: str, capfd: pytest.CaptureFixture[str]) -> None:
    engine_url = as_role(db_url, ENGINE_ROLE)
    assert main(_serve("coordinator", engine_url)) == 0          # migrated: the engine role serves
    capfd.readouterr()
    with psycopg.connect(db_url) as conn:                        # as before V021
        conn.execute(f"REVOKE SELECT ON schema_migrations FROM {ENGINE_ROLE}")
    assert main(_serve("coordinator", engine_url)) == 1
    err = capfd.readouterr().err
    assert "V021 (the engine role's read of schema_migrations) pending" in err, err


def test_migrate_records_which_version_wrote_each_row(db_url: str) -> None:
    from composer_ops import __version__

    with psycopg.connect(db_url) as conn:
        assert {r[0] for r in conn.execute("SELECT composer_version FROM schema_migrations")} == {__version__}


@pytest.mark.parametrize("newer", ["a V file", "R files"])
def test_a_database_a_newer_version_migrated_serves_the_older_and_refuses_its_migrate(
        newer: str, db_url: str, capfd: pytest.CaptureFixture[str]) -> None:
    """Beside a newer schema (a rolling deploy, a restart after the upgrade's migrate) the
    older worker and coordinator start, as the changelog allows; the older migrate, which
    would put its older functions back, refuses and changes nothing."""
    with psycopg.connect(db_url) as conn:
        if newer == "a V file":
            conn.execute("INSERT INTO schema_migrations (script, version, name, checksum, composer_version) "
                         "VALUES ('V999__later.sql', 999, 'later', 'x', '9.0.0')")
        conn.execute("UPDATE schema_migrations SET checksum = 'newer', composer_version = '9.0.0' "
                     "WHERE version IS NULL")
        before = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'composer_pick'").fetchall()
    assert main(_serve("coordinator", db_url)) == 0
    capfd.readouterr()
    assert main(["migrate", "--database-url", db_url]) == 2
    err = capfd.readouterr().err
    assert "this database was migrated by a newer composer_ops (" in err and err.count("\n") == 1, err
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'composer_pick'").fetchall() == before
        assert conn.execute("SELECT count(*) > 0 FROM schema_migrations WHERE checksum = 'newer'").fetchone() == (True,)


def test_an_applied_file_unlike_this_versions_copy_is_refused_without_advising_migrate(
        db_url: str, capfd: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE schema_migrations SET checksum = 'edited' WHERE script = 'V005__map_and_children.sql'")
    assert main(_serve("worker", db_url)) == 1
    err = capfd.readouterr().err
    assert "this database's V005__map_and_children.sql differs from composer_ops " in err, err
    assert "run `composer-ops migrate`" not in err, err


def test_a_read_only_database_or_a_standby_is_refused(db_url: str, capfd: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        assert name is not None
        conn.execute(f'ALTER DATABASE "{name[0]}" SET default_transaction_read_only = on')
    assert main(_serve("coordinator", db_url)) == 1
    err = capfd.readouterr().err
    assert "this database is read-only: a worker or coordinator writes, so it needs the primary's URL" in err, err


def test_a_migrate_with_nothing_to_do_does_not_wait_for_readers_of_the_table(db_url: str) -> None:
    from composer_ops.db.migrate import migrate

    with psycopg.connect(db_url) as reader:
        reader.execute("SELECT count(*) FROM schema_migrations")          # ACCESS SHARE, held
        began = time.monotonic()
        assert migrate(db_url, lock_timeout_s=0.2, attempts=1) == []
        assert time.monotonic() - began < 10
        reader.rollback()


def test_the_version_column_is_added_once_within_the_lock_wait(db_url: str) -> None:
    from composer_ops.db.migrate import migrate
    from composer_ops.errors import ComposerError

    with psycopg.connect(db_url) as conn:
        conn.execute("ALTER TABLE schema_migrations DROP COLUMN composer_version")     # as 0.1.0 left it
    with psycopg.connect(db_url, application_name="pg_dump-ish") as reader:
        reader.execute("SELECT count(*) FROM schema_migrations")
        with pytest.raises(ComposerError, match=r"schema_migrations.composer_version: could not take its locks "
                                                r"within 0.2s in 2 attempts \(locks held by pid \d+ .*pg_dump-ish"):
            migrate(db_url, lock_timeout_s=0.2, attempts=2)
        reader.rollback()
    assert migrate(db_url) == []                    # the column only: every file is applied
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 'schema_migrations'::regclass "
                            "AND attname = 'composer_version'").fetchone() == (1,)


def test_a_start_behind_a_migrate_holding_the_table_gives_up_naming_it(
        db_url: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from composer_ops.db import migrate

    monkeypatch.setattr(migrate, "REQUIRE_LOCK_WAIT_S", 0.5)
    with psycopg.connect(db_url, application_name="composer-ops migrate") as holder:
        holder.execute("LOCK TABLE schema_migrations IN ACCESS EXCLUSIVE MODE")
        began = time.monotonic()
        code = main(_serve("coordinator", db_url))
        took = time.monotonic() - began
        holder.rollback()
    err = capfd.readouterr().err
    assert code == 1 and took < 20, (code, took, err)
    assert "could not read schema_migrations within 0.5s (locks held by pid " in err and \
        "a migrate may be running" in err, err
