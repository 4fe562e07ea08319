"""Fixtures shared by every test, and the checks that a pytest run tested what it should.

The server is :func:`composer_ops.testing.servers.session`'s primary, started on first
use (``COMPOSER_DATABASE_URL``, else ``COMPOSER_TEST_PGBIN``'s binaries, else the
embedded server); a template database is migrated once; each test that asks for
``db_url`` gets a fresh clone of it (CREATE DATABASE ... TEMPLATE), so tests are
isolated and fast. Every connection of the suite, subprocesses included, runs with a
non-UTC session TimeZone (PGTZ), because all time arithmetic must be UTC-correct
regardless.

Markers: every test that uses the server (through these fixtures) is marked ``db``
here; ``slow`` marks multi-process end-to-end tests. ``make test-fast`` runs
``-m "not db and not slow"`` with ``COMPOSER_TEST_NO_SERVER=1``, under which asking for
the server is an error rather than a silent start.

``--require DIR=N`` (repeatable) fails the run unless at least N tests under DIR are
selected, and unless at least one of them ran rather than being skipped: a leg of
``make test`` that collects nothing, or whose tests all skip for a missing install
step, fails instead of passing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

os.environ.setdefault("PGTZ", "America/New_York")

from hypothesis import HealthCheck, settings  # noqa: E402

from composer_ops import Engine  # noqa: E402
from composer_ops.testing import servers  # noqa: E402
from composer_ops.testing.servers import Server  # noqa: E402

# Hypothesis times each example (``deadline``, 200 ms) and the drawing of examples (the
# too_slow health check): a loaded machine fails those for its load, not for the code
# (issue 33: a Citus test failed "Input generation is slow" at load average 20). Both are
# off for every test; a test that sets its own suppress_health_check names too_slow too.
settings.register_profile("composer", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("composer")

#: Fixtures that reach the server; a test using any of them (directly or through
#: another fixture) is marked ``db``.
SERVER_FIXTURES = frozenset({"server", "admin_url", "template_db", "db_url", "empty_db_url", "conn"})
NO_SERVER = "COMPOSER_TEST_NO_SERVER"


@pytest.fixture(scope="session")
def server() -> Server:
    if os.environ.get(NO_SERVER) == "1":
        raise RuntimeError(f"{NO_SERVER}=1: this run has no database server; mark the test db or use the fixtures")
    return servers.session().primary


@pytest.fixture(scope="session")
def admin_url(server: Server) -> str:
    return server.admin_url


@pytest.fixture(scope="session")
def template_db(server: Server) -> Iterator[str]:
    from composer_ops.db.migrate import migrate

    name = f"composer_tpl_{uuid.uuid4().hex[:8]}"
    migrate(server.create_database(name))
    yield name
    server.drop_database(name)


@pytest.fixture
def db_url(server: Server, template_db: str) -> Iterator[str]:
    """A freshly migrated database of its own for this test."""
    with server.database(template=template_db) as url:
        yield url


@pytest.fixture
def empty_db_url(server: Server) -> Iterator[str]:
    """An empty database (no migrations applied) of its own for this test."""
    with server.database() as url:
        yield url


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection to the test's database, in a transaction rolled back at the end: a
    connection of the error boundary, as the repository gets in the product, so its
    driver errors arrive as ComposerErrors here too."""
    from composer_ops.db.errors import TranslatingConnection

    with TranslatingConnection.connect(db_url) as c:
        yield c
        c.rollback()


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An Engine on the test's database (a pool of 4). A module that needs definitions
    deployed overrides it with a fixture of the same name that takes this one."""
    with Engine.connect(db_url, pool_size=4) as e:
        yield e


# -- markers and collection checks ------------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--require", action="append", default=[], metavar="DIR=N",
                     help="fail unless at least N selected tests are under DIR and at least one of them runs")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.db)


def _requirements(config: pytest.Config) -> dict[Path, int]:
    wanted: dict[Path, int] = {}
    for spec in config.getoption("--require"):
        directory, sep, count = spec.rpartition("=")
        if not sep or not count.isdigit():
            raise pytest.UsageError(f"--require {spec}: expected DIR=N")
        wanted[(config.rootpath / directory).resolve()] = int(count)
    return wanted


def _under(item_path: Path, directory: Path) -> bool:
    return item_path == directory or directory in item_path.parents


class _Required:
    """The ``--require`` checks, run where the whole run is seen: in the pytest process
    itself or, under pytest-xdist (``-n``), in the controller, from each worker's
    collection and every test's report (a worker sees only the tests it was given, so
    this is not registered there)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.wanted = _requirements(config)
        self.ran: dict[Path, int] | None = None

    def _path(self, nodeid: str) -> Path:
        # A node id starts with its file's path relative to the rootdir.
        return (self.config.rootpath / nodeid.split("::", 1)[0]).resolve()

    def check_collected(self, paths: list[Path]) -> None:
        short = []
        for directory, minimum in self.wanted.items():
            found = sum(1 for path in paths if _under(path, directory))
            if found < minimum:
                short.append(f"{directory.relative_to(self.config.rootpath)}: {found} selected, at least {minimum} "
                             "expected")
        if short:
            raise pytest.UsageError("too few tests collected: " + "; ".join(short))
        self.ran = dict.fromkeys(self.wanted, 0)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.check_collected([item.path for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.check_collected([self._path(nodeid) for nodeid in ids])

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # An expected failure (xfail) ran; a skip did not.
        if self.ran is not None and report.when == "call" and (
                report.outcome != "skipped" or hasattr(report, "wasxfail")):
            path = self._path(report.nodeid)
            for directory in self.ran:
                if _under(path, directory):
                    self.ran[directory] += 1

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.ran or exitstatus != 0:
            return
        idle = [str(d.relative_to(self.config.rootpath)) for d, n in self.ran.items() if n == 0]
        if idle:
            self.config.get_terminal_writer().line(f"no test ran (all skipped) under: {', '.join(idle)}", red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):      # not an xdist worker
        config.pluginmanager.register(_Required(config), "composer-require")
