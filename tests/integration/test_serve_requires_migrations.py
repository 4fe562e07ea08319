"""A worker or coordinator refuses, at start, a database without its version's migrations.

Started against an empty database (a forgotten COMPOSER_DATABASE_URL) or one whose
upgrade skipped `migrate`, a worker logged "claim failed" for ever and looked alive: now
one line, exit 1, before anything is served."""

from __future__ import annotations

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
