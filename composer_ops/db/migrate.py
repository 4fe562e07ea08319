"""Apply ``sql/V*.sql`` in order, one transaction per file, under an advisory lock.

The files ship inside the package as ``composer_ops.migrations`` (built from sql/) and
are read through ``importlib.resources``, so an installed wheel migrates as the source
tree does.

Applied files are recorded in ``schema_migrations`` with a SHA-256 checksum; a file
that changed after it was applied is refused (``Invalid``), never silently re-run.
Two migrators at once: the second waits for the lock, then finds nothing to do.

On a Citus database (the ``citus`` extension is installed in it, or ``citus=True``)
the files of ``sql/citus/`` join the series: a version found only there runs on Citus
only (the distribution of the tables), and a version found in both directories, under
the same name, runs the ``sql/citus/`` file instead of the plain one. Versions are one
sequence across both directories. A single-server database migrated earlier is
converted by migrating it again once the extension and its worker nodes are set up
(docs/scaling.md): the Citus-only versions it lacks are applied then.
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

from composer_ops.db.connect import connect, resolve_url
from composer_ops.errors import ComposerError, Invalid

log = logging.getLogger(__name__)

#: The migration files: the ``composer_ops.migrations`` package.
SQL_DIR: Traversable = importlib.resources.files("composer_ops.migrations")
_NAME = re.compile(r"^V(\d{3,})__([a-z0-9_]+)\.sql$")
_LOCK_KEY = "composer_migrations"
#: Migrations that run on Citus only, or instead of the plain file of their version.
CITUS_DIR_NAME = "citus"


@dataclass(frozen=True, kw_only=True)
class Migration:
    version: int
    name: str
    path: Traversable
    checksum: str
    citus: bool = False    # from sql/citus/: applied on a Citus database only

    @property
    def filename(self) -> str:
        return self.path.name


def discover(sql_dir: Traversable = SQL_DIR, *, citus: bool = False) -> list[Migration]:
    """The migration files (``V*.sql``), ordered by version; a malformed name is an
    error. With ``citus``, the series a Citus database runs (``sql/citus/`` overlaid)."""
    plain = _scan(sql_dir, citus=False)
    citus_dir = sql_dir / CITUS_DIR_NAME
    variants = _scan(citus_dir, citus=True) if citus_dir.is_dir() else []
    by_version = {m.version: m for m in plain}
    for mig in variants:
        same = by_version.get(mig.version)
        # Checked in both modes, so a single-server run already catches a plain file
        # given a number a Citus-only file took (it would be replaced on Citus).
        if same is not None and same.name != mig.name:
            raise Invalid(f"{mig.path} and {same.path} share version {mig.version}; a file in sql/citus/ "
                          "replaces the plain file of its version only under the same name")
    if not citus:
        return plain
    by_version.update({m.version: m for m in variants})
    return sorted(by_version.values(), key=lambda m: m.version)


def _scan(sql_dir: Traversable, *, citus: bool) -> list[Migration]:
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
                               checksum=hashlib.sha256(body).hexdigest(), citus=citus))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise Invalid(f"{sql_dir}: two migration files share a version number")
    return sorted(found, key=lambda m: m.version)


def is_citus(conn: psycopg.Connection[Any]) -> bool:
    """True when the database has the citus extension (a Citus coordinator)."""
    row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')").fetchone()
    return bool(row and row[0])


def _accepted_checksums(mig: Migration, sql_dir: Traversable) -> set[str]:
    """The checksums an applied ``mig.version`` may carry: its own file's, and for a
    Citus replacement also the plain file's (applied before the database was converted)."""
    accepted = {mig.checksum}
    if mig.citus:
        accepted |= {m.checksum for m in _scan(sql_dir, citus=False) if m.version == mig.version}
    return accepted


def _applied(conn: psycopg.Connection[Any]) -> dict[int, str]:
    rows = conn.execute("SELECT version, checksum FROM schema_migrations").fetchall()
    return {int(v): str(c) for v, c in rows}


def migrate(url: str | None = None, *, sql_dir: Traversable = SQL_DIR, target: int | None = None,
            on_apply: Callable[[Migration], None] | None = None, citus: bool | None = None) -> list[Migration]:
    """Apply every pending migration up to ``target``; return the ones applied.

    ``citus``: None detects a Citus database (the extension is installed); True
    requires one (``composer-ops migrate --citus``); False applies the plain series."""
    applied_now: list[Migration] = []
    with connect(resolve_url(url), application_name="composer-ops migrate", autocommit=True) as conn:
        on_citus = is_citus(conn)
        if citus and not on_citus:
            raise Invalid("--citus: this database has no citus extension; create it (CREATE EXTENSION citus) "
                          "and add the worker nodes first (docs/scaling.md)")
        files = discover(sql_dir, citus=on_citus if citus is None else citus)
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
                    if done[mig.version] not in _accepted_checksums(mig, sql_dir):
                        raise Invalid(
                            f"{mig.filename} was changed after it was applied "
                            f"(recorded checksum {done[mig.version][:12]}, file has {mig.checksum[:12]}); "
                            "add a new migration instead of editing an applied one"
                        )
                    continue
                if target is not None and mig.version > target:
                    break
                with conn.transaction():
                    if on_citus:
                        # A migration mixes DDL on distributed tables (Citus fans it out over
                        # several connections per node) with statements Citus then refuses in
                        # the same transaction ("cannot run function command because there was
                        # a parallel operation on a distributed table"); one connection per
                        # node, in order, runs them all.
                        conn.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
                    try:
                        conn.execute(mig.path.read_text(encoding="utf-8").encode())
                    except ComposerError as exc:
                        raise ComposerError(f"{mig.filename} failed: {exc}") from exc
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
    """Each migration file of the database's series (plain or Citus) and whether it is
    applied; reads a running server only (it never starts the embedded one)."""
    with connect(url, application_name="composer-ops migrate") as conn:
        files = discover(sql_dir, citus=is_citus(conn))
        exists = conn.execute("SELECT to_regclass('schema_migrations') IS NOT NULL").fetchone()
        done = _applied(conn) if exists and exists[0] else {}
    return [(m, m.version in done) for m in files]
