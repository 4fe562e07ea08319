"""The test/bench server manager: a cluster from a directory of binaries, on TCP when
asked, with extra settings, grouped by role, restarted and stopped."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest

from composer_ops.testing import servers
from composer_ops.testing.servers import RestartUnsupported, ServerGroup

BIN = Path(os.environ.get(servers.ENV_PGBIN) or "/usr/lib/postgresql/15/bin")

needs_binaries = pytest.mark.skipif(not (BIN / "initdb").exists(), reason=f"no PostgreSQL server binaries in {BIN}")


@needs_binaries
def test_a_group_of_two_clusters_one_on_tcp_with_settings() -> None:
    group = ServerGroup({ServerGroup.PRIMARY: servers.start_cluster(BIN)})
    other = group.add("replica", servers.start_cluster_on_free_port(BIN, settings={"application_name": "grouped"}))
    port = other.port
    try:
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres") as conn:   # TCP
            assert conn.execute("SHOW application_name").fetchone() == ("grouped",)
        assert group.primary.version_num // 10000 == other.version_num // 10000
        with group.primary.database() as url, psycopg.connect(url) as conn:
            assert conn.execute("SELECT current_database()").fetchone() != ("postgres",)
        assert other.restart() > 0
        with psycopg.connect(other.admin_url) as conn:                                     # Unix socket
            assert conn.execute("SELECT 1").fetchone() == (1,)
        with pytest.raises(KeyError, match="roles: primary, replica"):
            group["standby"]
        with pytest.raises(ValueError, match="taken"):
            group.add("replica", other)
    finally:
        group.stop()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(other.admin_url, connect_timeout=2)


def test_an_external_server_is_not_ours_to_restart_or_stop() -> None:
    server = servers.external("postgresql://someone@db.invalid/app")
    assert server.admin_url == "postgresql://someone@db.invalid/postgres" and not server.owned
    with pytest.raises(RestartUnsupported):
        server.restart()
    with pytest.raises(RestartUnsupported):
        server.stop()
