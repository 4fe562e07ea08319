"""The Citus leg (``make test-citus``): a coordinator and two worker nodes of Citus 13 on
PostgreSQL 15, started once per session (:mod:`composer_ops.testing.citus`).

One Citus database is created and migrated (``composer-ops migrate`` detects Citus and
distributes the tables) once; ``db_url`` hands it to each test after deleting every row
and dropping the partitions earlier tests added. A database per test, as the other
legs clone, costs about 6 s on Citus (the extension and node registration on three
servers, then the distribution); the reset costs a few tens of milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from composer_ops.db.migrate import migrate
from composer_ops.testing import citus


@pytest.fixture(scope="session")
def citus_cluster() -> Iterator[citus.CitusCluster]:
    # Without autovacuum: every test deletes the rows of the one database (``db_url``),
    # so autovacuum keeps visiting its shards, and a VACUUM of a month's shard deadlocked
    # with the ANALYZE of the seed's transaction, which held the locks of the partitions
    # it had just created (the seed lost, at random, once in about 30 seeds under load).
    cluster = citus.CitusCluster.start(workers=2, settings={"autovacuum": "off"})
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def citus_db(citus_cluster: citus.CitusCluster) -> Iterator[str]:
    with citus_cluster.database() as url:
        migrate(url)
        yield url


@pytest.fixture(scope="session")
def citus_baseline(citus_db: str) -> citus.Baseline:
    return citus.baseline(citus_db)


@pytest.fixture
def db_url(citus_db: str, citus_baseline: citus.Baseline) -> Iterator[str]:
    """The session's Citus database, emptied: no rows, the partitions it was migrated with.
    A test that leaves a table distributed otherwise than migrated fails in its teardown
    (the tests after it would run on that layout: tests.flaky's random order found one)."""
    citus.reset(citus_db, citus_baseline)
    yield citus_db
    changed = citus.drift(citus_db, citus_baseline)
    assert not changed, f"the test left the distribution changed: {changed}"
