"""Fixtures shared by every test.

A server is found or started once per session (see tests/pgcluster.py); a template
database is migrated once; each test that asks for ``db_url`` gets a fresh clone of
it (CREATE DATABASE ... TEMPLATE), so tests are isolated and fast.
Every connection of the suite, subprocesses included, runs with a non-UTC session
TimeZone (PGTZ), because all time arithmetic must be UTC-correct regardless.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

os.environ.setdefault("PGTZ", "America/New_York")

from tests.pgcluster import server_url  # noqa: E402


def with_database(url: str, name: str) -> str:
    """The same server URL pointing at database ``name``."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@pytest.fixture(scope="session")
def admin_url() -> str:
    return with_database(server_url(), "postgres")


@pytest.fixture(scope="session")
def template_db(admin_url: str) -> Iterator[str]:
    from composer_ops.db.migrate import migrate

    name = f"composer_tpl_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    migrate(with_database(admin_url, name))
    yield name
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


_counter = itertools.count()


def clone_database(admin_url: str, template: str | None) -> str:
    name = f"composer_t{os.getpid()}_{next(_counter)}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if template:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)))
        else:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return name


def drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def db_url(admin_url: str, template_db: str) -> Iterator[str]:
    """A freshly migrated database of its own for this test."""
    name = clone_database(admin_url, template_db)
    yield with_database(admin_url, name)
    drop_database(admin_url, name)


@pytest.fixture
def empty_db_url(admin_url: str) -> Iterator[str]:
    """An empty database (no migrations applied) of its own for this test."""
    name = clone_database(admin_url, None)
    yield with_database(admin_url, name)
    drop_database(admin_url, name)


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection to the test's database, in a transaction rolled back at the end."""
    with psycopg.connect(db_url) as c:
        yield c
        c.rollback()
