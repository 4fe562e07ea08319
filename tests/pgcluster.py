"""Throwaway PostgreSQL servers for the test suite.

``COMPOSER_DATABASE_URL`` wins (an existing server; the suite creates and drops its
own databases on it). Else ``COMPOSER_TEST_PGBIN`` names a directory of server
binaries (CI uses Debian's /usr/lib/postgresql/15/bin) and a cluster is initialised
in a temporary directory. Else the embedded server (PostgreSQL 18) is started in a
temporary directory and deleted when the session ends.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path


def _as_postgres(cmd: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root; Debian's package ships a postgres user.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def start_cluster(bindir: str) -> str:
    """initdb + pg_ctl start a cluster from ``bindir``; returns an admin URL."""
    base = Path(tempfile.mkdtemp(prefix="composer-pg-"))
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chmod(base, 0o755)
        os.chown(base, pw.pw_uid, pw.pw_gid)
        os.chown(sock, pw.pw_uid, pw.pw_gid)
    subprocess.run(_as_postgres([f"{bindir}/initdb", "-D", str(data), "-U", "postgres", "--auth=trust",
                                 "--encoding=UTF8", "--no-sync"]), check=True, capture_output=True)
    opts = f"-c listen_addresses='' -k {sock} -c max_connections=200 -c fsync=off"
    subprocess.run(_as_postgres([f"{bindir}/pg_ctl", "-D", str(data), "-w", "-l", str(base / "log"),
                                 "-o", opts, "start"]), check=True, capture_output=True)

    def stop() -> None:
        subprocess.run(_as_postgres([f"{bindir}/pg_ctl", "-D", str(data), "-m", "immediate", "stop"]),
                       check=False, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)

    atexit.register(stop)
    return f"postgresql://postgres@/postgres?host={sock}"


def start_embedded() -> str:
    from composer_ops.db import embedded

    base = Path(tempfile.mkdtemp(prefix="composer-pg18-"))
    return embedded.up(base, detached=False, delete_on_exit=True, database="postgres")


def server_url() -> str:
    url = os.environ.get("COMPOSER_DATABASE_URL")
    if url:
        return url
    bindir = os.environ.get("COMPOSER_TEST_PGBIN")
    if bindir:
        return start_cluster(bindir)
    return start_embedded()
