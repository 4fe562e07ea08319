"""Apply ``sql/V*.sql`` in order, one transaction per file, under an advisory lock.

The files ship inside the package as ``composer_ops.migrations`` (built from sql/) and
are read through ``importlib.resources``, so an installed wheel migrates as the source
tree does.

Applied files are recorded in ``schema_migrations`` with a SHA-256 checksum; a file
that changed after it was applied is refused (``Invalid``), never silently re-run.
Two migrators at once: the second waits for the lock, then finds nothing to do.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from typing import Any

import psycopg

from composer_ops.db.connect import connect
from composer_ops.errors import ComposerError, Invalid

log = logging.getLogger(__name__)

#: The migration files: the ``composer_ops.migrations`` package.
SQL_DIR: Traversable = importlib.resources.files("composer_ops.migrations")
_NAME = re.compile(r"^V(\d{3,})__([a-z0-9_]+)\.sql$")
_LOCK_KEY = "composer_migrations"


@dataclass(frozen=True, kw_only=True)
class Migration:
    version: int
    name: str
    path: Traversable
    checksum: str

    @property
    def filename(self) -> str:
        return self.path.name


def discover(sql_dir: Traversable = SQL_DIR) -> list[Migration]:
    """The migration files (``V*.sql``), ordered by version; a malformed name is an error."""
    if not sql_dir.is_dir():
        raise ComposerError(f"migrations directory {sql_dir} does not exist")
    found: list[Migration] = []
    for path in sorted((p for p in sql_dir.iterdir() if p.name.startswith("V") and p.name.endswith(".sql")),
                       key=lambda p: p.name):
        m = _NAME.match(path.name)
        if not m:
            raise Invalid(f"{path}: migration files are named V<NNN>__<snake_case>.sql")
        body = path.read_bytes()
        found.append(Migration(version=int(m.group(1)), name=m.group(2), path=path,
                               checksum=hashlib.sha256(body).hexdigest()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise Invalid(f"{sql_dir}: two migration files share a version number")
    return sorted(found, key=lambda m: m.version)


def _applied(conn: psycopg.Connection[Any]) -> dict[int, str]:
    rows = conn.execute("SELECT version, checksum FROM schema_migrations").fetchall()
    return {int(v): str(c) for v, c in rows}


def migrate(url: str | None = None, *, sql_dir: Traversable = SQL_DIR, target: int | None = None,
            on_apply: Callable[[Migration], None] | None = None) -> list[Migration]:
    """Apply every pending migration up to ``target``; return the ones applied."""
    files = discover(sql_dir)
    applied_now: list[Migration] = []
    with connect(url, application_name="composer-ops migrate", autocommit=True) as conn:
        # Session-level lock: held across the per-file transactions below.
        conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (_LOCK_KEY,))
        try:
            conn.execute(
                """CREATE TABLE IF NOT EXISTS schema_migrations(
                       version INT PRIMARY KEY,
                       name TEXT NOT NULL,
                       checksum TEXT NOT NULL,
                       applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"""
            )
            done = _applied(conn)
            for mig in files:
                if mig.version in done:
                    if done[mig.version] != mig.checksum:
                        raise Invalid(
                            f"{mig.filename} was changed after it was applied "
                            f"(recorded checksum {done[mig.version][:12]}, file has {mig.checksum[:12]}); "
                            "add a new migration instead of editing an applied one"
                        )
                    continue
                if target is not None and mig.version > target:
                    break
                with conn.transaction():
                    try:
                        conn.execute(mig.path.read_text(encoding="utf-8").encode())
                    except psycopg.Error as exc:
                        raise ComposerError(f"{mig.filename} failed: {str(exc).strip().splitlines()[0]}") from exc
                    conn.execute(
                        "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                        (mig.version, mig.name, mig.checksum),
                    )
                log.info("applied %s", mig.filename)
                applied_now.append(mig)
                if on_apply:
                    on_apply(mig)
        finally:
            conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (_LOCK_KEY,))
    return applied_now


def status(url: str | None = None, *, sql_dir: Traversable = SQL_DIR) -> list[tuple[Migration, bool]]:
    """Each migration file and whether it is applied."""
    files = discover(sql_dir)
    with connect(url, application_name="composer-ops migrate") as conn:
        exists = conn.execute("SELECT to_regclass('schema_migrations') IS NOT NULL").fetchone()
        done = _applied(conn) if exists and exists[0] else {}
    return [(m, m.version in done) for m in files]
