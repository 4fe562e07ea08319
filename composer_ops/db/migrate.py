"""Apply the migrations of ``sql/``: the ``V*.sql`` files in order, then the ``R__*.sql`` files.

Under one advisory lock: each pending ``V<NNN>__<name>.sql`` (tables, indexes, roles,
grants) once, in its own transaction, recorded in ``schema_migrations`` with a checksum
(a changed applied file is refused, never re-run); then, when a V file was applied or an
R file is new or changed, every ``R__<name>.sql`` (the current body of every SQL
function) in name order in one transaction. On Citus, ``sql/citus/`` joins the series
(its R files run after the plain ones). Files ship as ``composer_ops.migrations``. A
database built by the pre-release migrations is refused with one line: re-create it.

Each file's transaction waits at most ``lock_timeout_s`` for any lock (``SET LOCAL
lock_timeout``): a migration's ALTER queued behind a long reader would otherwise queue
every later statement on that table, the engine's included, for as long as the reader
lasts. A file whose locks stay busy is rolled back and tried again with backoff, up to
``attempts`` times, then refused naming the sessions that hold locks longest.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from typing import Any, NoReturn

import psycopg
from packaging.version import InvalidVersion, Version
from psycopg import sql

from composer_ops.db import roles
from composer_ops.db.connect import connect, resolve_url
from composer_ops.db.retry import backoff_delay
from composer_ops.errors import ComposerError, Invalid, LockTimeout, PermissionDenied
from composer_ops.repo import locks, partitions

log = logging.getLogger(__name__)

#: The migration files: the ``composer_ops.migrations`` package.
SQL_DIR: Traversable = importlib.resources.files("composer_ops.migrations")
_NAME = re.compile(r"^V(\d{3,})__([a-z0-9_]+)\.sql$")
_REPEATABLE = re.compile(r"^R__([a-z0-9_]+)\.sql$")
_LOCK_KEY = "composer_migrations"
#: How long, by default, a migration's statements wait for a lock, and how many times a
#: file whose locks stay busy is tried (``composer-ops migrate --lock-timeout/--attempts``).
LOCK_TIMEOUT_S = 2.0
LOCK_ATTEMPTS = 5
#: Migrations that run on Citus only, or instead of the plain file of their name.
CITUS_DIR_NAME = "citus"
#: The one line a database of the pre-release migrations gets.
PRE_RELEASE = ("this database was created by a pre-release schema of composer_ops (its schema_migrations "
               "records the migrations squashed into the 0.1.0 baseline); it must be re-created: drop it, "
               "create it empty and run `composer-ops migrate`")


@dataclass(frozen=True, kw_only=True)
class Script:
    """One file of ``sql/`` (or ``sql/citus/``)."""

    name: str
    path: Traversable
    checksum: str
    citus: bool = False    # from sql/citus/

    @property
    def filename(self) -> str:
        return self.path.name

    @property
    def key(self) -> str:
        """How ``schema_migrations`` names it: ``citus/`` and the file name for a Citus file."""
        return f"{CITUS_DIR_NAME}/{self.filename}" if self.citus else self.filename


@dataclass(frozen=True, kw_only=True)
class Migration(Script):
    """A versioned file, ``V<NNN>__<name>.sql``: applied once."""

    version: int


@dataclass(frozen=True, kw_only=True)
class Repeatable(Script):
    """A repeatable file, ``R__<name>.sql``: applied again whenever the series changes."""


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


def discover_repeatable(sql_dir: Traversable = SQL_DIR, *, citus: bool = False) -> list[Repeatable]:
    """The repeatable files (``R__*.sql``) in the order they run: the plain ones by name
    (with ``citus``, a ``sql/citus/`` file of the same name instead), then with
    ``citus`` the Citus-only ones by name."""
    plain = _scan_repeatable(sql_dir, citus=False)
    citus_dir = sql_dir / CITUS_DIR_NAME
    if not citus or not citus_dir.is_dir():
        return plain
    variants = {r.name: r for r in _scan_repeatable(citus_dir, citus=True)}
    replaced = [variants.pop(r.name, r) for r in plain]
    return replaced + sorted(variants.values(), key=lambda r: r.name)


def _files(sql_dir: Traversable, prefix: str) -> list[Traversable]:
    if not sql_dir.is_dir():
        raise ComposerError(f"migrations directory {sql_dir} does not exist")
    return sorted((p for p in sql_dir.iterdir() if p.name.startswith(prefix) and p.name.endswith(".sql")),
                  key=lambda p: p.name)


def _checksum(path: Traversable) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _scan(sql_dir: Traversable, *, citus: bool) -> list[Migration]:
    found: list[Migration] = []
    for path in _files(sql_dir, "V"):
        m = _NAME.match(path.name)
        if not m:
            raise Invalid(f"{path}: migration files are named V<NNN>__<snake_case>.sql")
        found.append(Migration(version=int(m.group(1)), name=m.group(2), path=path, checksum=_checksum(path),
                               citus=citus))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise Invalid(f"{sql_dir}: two migration files share a version number")
    return sorted(found, key=lambda m: m.version)


def _scan_repeatable(sql_dir: Traversable, *, citus: bool) -> list[Repeatable]:
    found: list[Repeatable] = []
    for path in _files(sql_dir, "R"):
        m = _REPEATABLE.match(path.name)
        if not m:
            raise Invalid(f"{path}: repeatable files are named R__<snake_case>.sql")
        found.append(Repeatable(name=m.group(1), path=path, checksum=_checksum(path), citus=citus))
    return sorted(found, key=lambda r: r.name)


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


_TABLE = """CREATE TABLE IF NOT EXISTS schema_migrations(
                 script TEXT PRIMARY KEY,     -- the file: V001__init.sql, R__claim.sql, citus/...
                 version INT UNIQUE,          -- a V file's version; NULL for a repeatable file
                 name TEXT NOT NULL,
                 checksum TEXT NOT NULL,
                 applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                 composer_version TEXT)       -- the package whose migrate wrote the row"""
#: The column a table made before 0.2 lacks: the package version whose migrate wrote a
#: row (a later version's rows tell an older package's migrate and workers that the
#: database is newer than they are). Added once, under the migration lock wait.
_VERSION_COLUMN = "ALTER TABLE schema_migrations ADD COLUMN composer_version TEXT"


@dataclass(frozen=True)
class Recorded:
    """What ``schema_migrations`` holds: the applied versions' checksums, the repeatable
    files' (by key), and the package versions whose ``migrate`` wrote its rows (none
    before 0.2: the column came then)."""

    versions: dict[int, str]
    repeatable: dict[str, str]
    by: dict[str, str] = field(default_factory=dict)    # script -> composer_version, where recorded
    has_version_column: bool = True

    def newer_than_package(self, files: Sequence[Migration]) -> str | None:
        """Why this database is a newer package's (a V file this package does not have,
        or rows a later version's ``migrate`` wrote), or None."""
        known = max((m.version for m in files), default=0)
        beyond = sorted(v for v in self.versions if v > known)
        if beyond:
            return f"it holds V{beyond[-1]:03d}, and composer_ops {_package()} knows up to V{known:03d}"
        later = sorted({v for v in self.by.values() if _newer_version(v, _package())}, key=Version)
        if later:
            return f"composer_ops {later[-1]}'s migrate wrote it, and this is {_package()}"
        return None


def _package() -> str:
    """This package's version (imported late: the package imports this module)."""
    from composer_ops import __version__

    return __version__


def _newer_version(recorded: str, mine: str) -> bool:
    try:
        return Version(recorded) > Version(mine)
    except InvalidVersion:
        return False


def _recorded(conn: psycopg.Connection[Any]) -> Recorded | None:
    """What ``schema_migrations`` holds (:class:`Recorded`); None when the database has
    none yet. A table without the ``script`` column is the pre-release runner's: refused."""
    columns = {r[0] for r in conn.execute(
        """SELECT a.attname FROM pg_attribute a
            WHERE a.attrelid = to_regclass('schema_migrations') AND a.attnum > 0 AND NOT a.attisdropped""")}
    if not columns:
        return None
    if "script" not in columns:
        raise Invalid(PRE_RELEASE)
    by = "composer_version" if "composer_version" in columns else "NULL::text"
    rows = conn.execute(f"SELECT script, version, checksum, {by} FROM schema_migrations").fetchall()
    return Recorded(versions={int(v): str(c) for _, v, c, _ in rows if v is not None},
                    repeatable={str(k): str(c) for k, v, c, _ in rows if v is None},
                    by={str(k): str(b) for k, _, _, b in rows if b},
                    has_version_column="composer_version" in columns)


def _run(conn: psycopg.Connection[Any], script: Script, *, on_citus: bool) -> None:
    if on_citus:
        # A migration mixes DDL on distributed tables (Citus fans it out over several
        # connections per node) with statements Citus then refuses in the same
        # transaction ("cannot run function command because there was a parallel
        # operation on a distributed table"); one connection per node, in order, runs them all.
        conn.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
    try:
        conn.execute(script.path.read_text(encoding="utf-8").encode())
    except LockTimeout:
        raise                       # waited out and tried again by _locking
    except ComposerError as exc:
        raise ComposerError(f"{script.filename} failed: {exc}") from exc


def _locking(conn: psycopg.Connection[Any], what: str, body: Callable[[], None], *, lock_timeout_s: float,
             attempts: int) -> None:
    """``body`` in a transaction whose lock waits end after ``lock_timeout_s``; a lock
    timeout rolls it back and, after a backoff, runs it again, up to ``attempts`` times,
    then raises naming who holds locks (:func:`locks.holders_text_on`)."""
    for attempt in range(1, attempts + 1):
        try:
            with conn.transaction():
                conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(
                    sql.Literal(f"{max(1, round(lock_timeout_s * 1000))}ms")))
                body()
            return
        except LockTimeout as exc:
            if attempt >= attempts:
                holders = locks.holders_text_on(contextlib.nullcontext(conn))
                raise ComposerError(
                    f"{what}: could not take its locks within {lock_timeout_s:g}s in {attempts} attempts "
                    f"({holders}); nothing of it was applied: end that transaction "
                    "or try again later (--lock-timeout, --attempts)") from exc
            delay = backoff_delay(attempt - 1, base=0.25, cap=4.0)
            log.warning("%s: a lock was busy for %gs (attempt %d of %d); trying again in %.2fs",
                        what, lock_timeout_s, attempt, attempts, delay)
            time.sleep(delay)



def migrate(url: str | None = None, *, sql_dir: Traversable = SQL_DIR, target: int | None = None,
            on_apply: Callable[[Script], None] | None = None, citus: bool | None = None,
            lock_timeout_s: float = LOCK_TIMEOUT_S, attempts: int = LOCK_ATTEMPTS) -> list[Script]:
    """Apply every pending migration up to ``target``, then the repeatable files if
    anything changed; return the files applied. Each file waits at most
    ``lock_timeout_s`` for a lock and is tried ``attempts`` times (see the module).

    ``citus``: None detects a Citus database (the extension is installed); True
    requires one (``composer-ops migrate --citus``); False applies the plain series.
    ``target`` (tests) stops after that version: the schema of that version with the
    current functions."""
    if not lock_timeout_s > 0 or lock_timeout_s == float("inf"):
        raise Invalid(f"the lock timeout must be a positive number of seconds, got {lock_timeout_s!r}")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise Invalid(f"attempts must be an integer, 1 or more, got {attempts!r}")
    applied_now: list[Script] = []
    with connect(resolve_url(url), application_name="composer-ops migrate", autocommit=True) as conn:
        on_citus = is_citus(conn)
        if citus and not on_citus:
            raise Invalid("--citus: this database has no citus extension; create it (CREATE EXTENSION citus) "
                          "and add the worker nodes first (docs/scaling.md)")
        series = on_citus if citus is None else citus
        files = discover(sql_dir, citus=series)
        repeatable = discover_repeatable(sql_dir, citus=series)
        roles.require_owner(conn, "migrate", "it creates and changes the schema's tables, functions and grants")
        # Session-level lock: held across the per-file transactions below.
        conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (_LOCK_KEY,))
        try:
            recorded = _recorded(conn)
            if recorded is None:
                conn.execute(_TABLE)
                recorded = Recorded(versions={}, repeatable={})
            newer = recorded.newer_than_package(files)
            if newer is not None:
                raise Invalid(f"this database was migrated by a newer composer_ops ({newer}): this migrate would "
                              "put its older functions back; run the newer version's migrate, or keep this "
                              "version's processes on the schema as it is if the changelog allows it")
            if not recorded.has_version_column:
                def add_column() -> None:
                    conn.execute(_VERSION_COLUMN)

                _locking(conn, "schema_migrations.composer_version", add_column, lock_timeout_s=lock_timeout_s,
                         attempts=attempts)
            done, done_repeatable = recorded.versions, recorded.repeatable
            if on_citus and any(m.version not in done for m in files):
                _drop_repeatable_triggers(conn)
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
                def apply(mig: Migration = mig) -> None:
                    _run(conn, mig, on_citus=on_citus)
                    conn.execute(
                        "INSERT INTO schema_migrations (script, version, name, checksum, composer_version) "
                        "VALUES (%s, %s, %s, %s, %s)",
                        (mig.key, mig.version, mig.name, mig.checksum, _package()),
                    )

                _locking(conn, mig.filename, apply, lock_timeout_s=lock_timeout_s, attempts=attempts)
                log.info("applied %s", mig.filename)
                applied_now.append(mig)
                if on_apply:
                    on_apply(mig)
            if applied_now or done_repeatable != {r.key: r.checksum for r in repeatable}:
                applied_now += _apply_repeatable(conn, repeatable, on_citus=on_citus, on_apply=on_apply,
                                                 lock_timeout_s=lock_timeout_s, attempts=attempts)
        finally:
            conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (_LOCK_KEY,))
    return applied_now


#: Triggers an R file creates on a single server only (sql/R__claim.sql frees a task's
#: flow slot): Citus refuses to distribute a table that has one, so a single-server
#: database converted to Citus loses them before its V files run; the R files, which
#: run after the V files, re-create what the database supports.
_REPEATABLE_TRIGGERS = (("composer_free_flow_slot", "task_instances"),)


def _drop_repeatable_triggers(conn: psycopg.Connection[Any]) -> None:
    for trigger, table in _REPEATABLE_TRIGGERS:
        if conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone() == (True,):
            conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(sql.Identifier(trigger),
                                                                         sql.Identifier(table)))


def _apply_repeatable(conn: psycopg.Connection[Any], repeatable: Sequence[Repeatable], *, on_citus: bool,
                      on_apply: Callable[[Script], None] | None, lock_timeout_s: float = LOCK_TIMEOUT_S,
                      attempts: int = LOCK_ATTEMPTS) -> list[Script]:
    """Run every repeatable file, in order, in one transaction, and record them (the
    rows of files that are gone go with it)."""
    def apply() -> None:
        for rep in repeatable:
            _run(conn, rep, on_citus=on_citus)
        conn.execute("DELETE FROM schema_migrations WHERE version IS NULL")
        for rep in repeatable:
            conn.execute("INSERT INTO schema_migrations (script, name, checksum, composer_version) "
                         "VALUES (%s, %s, %s, %s)", (rep.key, rep.name, rep.checksum, _package()))

    _locking(conn, "the repeatable files (R__*.sql)", apply, lock_timeout_s=lock_timeout_s, attempts=attempts)
    for rep in repeatable:
        log.info("applied %s", rep.filename)
        if on_apply:
            on_apply(rep)
    return list(repeatable)


#: What :func:`status` says of a file: applied (a repeatable file: as it is now), pending,
#: or changed (a versioned file edited after it was applied, which :func:`migrate` refuses).
APPLIED, PENDING, CHANGED = "applied", "pending", "changed"


def status(url: str | None = None, *, sql_dir: Traversable = SQL_DIR) -> list[tuple[Script, str]]:
    """Each file of the database's series (plain or Citus) and its state
    (:data:`APPLIED`, :data:`PENDING`, :data:`CHANGED`); reads a running server only (it
    never starts the embedded one)."""
    with connect(url, application_name="composer-ops migrate") as conn:
        series = is_citus(conn)
        return _states(sql_dir, discover(sql_dir, citus=series), discover_repeatable(sql_dir, citus=series),
                       _recorded(conn))


#: How long a worker's or coordinator's start-up check waits for schema_migrations.
REQUIRE_LOCK_WAIT_S = 10.0


def require_current(conn: psycopg.Connection[Any], *, sql_dir: Traversable = SQL_DIR) -> None:
    """Raise :class:`ComposerError` (one line, naming what is missing) unless the
    database holds every migration of this version, applied as shipped: what a worker
    or coordinator checks before it serves anything. A role refused the read of
    ``schema_migrations`` (the engine role's grant came with V021) is told the same."""
    try:
        with conn.transaction():
            standby, read_only = conn.execute(
                "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'").fetchone() or (0, 0)
            if standby or read_only:
                raise ComposerError(f"this database is {'a hot standby' if standby else 'read-only'}: a worker or "
                                    "coordinator writes, so it needs the primary's URL")
            # A migrate altering the table holds it: waited for a while, then said.
            partitions.set_lock_timeout(conn, REQUIRE_LOCK_WAIT_S)
            series = is_citus(conn)
            files = discover(sql_dir, citus=series)
            recorded = _recorded(conn)
            if recorded is not None and recorded.newer_than_package(files) is not None:
                return          # a newer version's schema: the changelog says whether this one runs on it
            states = _states(sql_dir, files, discover_repeatable(sql_dir, citus=series), recorded)
    except (PermissionDenied, psycopg.errors.InsufficientPrivilege):
        _refuse("V021 (the engine role's read of schema_migrations) pending, maybe more")
    except LockTimeout as exc:
        holders = locks.holders_text_on(contextlib.nullcontext(conn), ["schema_migrations"])
        raise ComposerError(f"could not read schema_migrations within {REQUIRE_LOCK_WAIT_S:g}s ({holders}): a "
                            "migrate may be running; start again once it is done") from exc
    changed = [script.key for script, state in states if state == CHANGED]
    if changed:
        by = recorded.by if recorded is not None else {}
        named = ", ".join(key + (f" (written by composer_ops {by[key]}'s migrate)"
                                 if by.get(key, _package()) != _package() else "") for key in changed[:3])
        raise ComposerError(
            f"this database's {named} differs from composer_ops {_package()}'s copy: edited after it was applied, "
            "or applied by another build; this version's migrations do not describe the schema, so it does not "
            "serve it (and its migrate refuses it too)")
    off = [f"{script.key} {state}" for script, state in states if state != APPLIED]
    if not off:
        return
    versions = [state for script, state in states if isinstance(script, Migration)]
    if versions and all(state == PENDING for state in versions):
        _refuse("no composer_ops schema is installed here")
    _refuse(", ".join(off[:3]) + (f" and {len(off) - 3} more" if len(off) > 3 else ""))


def _refuse(missing: str) -> NoReturn:
    raise ComposerError(f"this database is not migrated for composer_ops {_package()}: {missing}; run "
                        "`composer-ops migrate` with the owner's URL first (README.md, \"Upgrading\")")


def _states(sql_dir: Traversable, files: Sequence[Migration], repeatable: Sequence[Repeatable],
            recorded: Recorded | None) -> list[tuple[Script, str]]:
    """Each of ``files`` and ``repeatable`` with its state against ``recorded``."""
    done, done_repeatable = (recorded.versions, recorded.repeatable) if recorded is not None else ({}, {})

    def versioned(m: Migration) -> str:
        if m.version not in done:
            return PENDING
        return APPLIED if done[m.version] in _accepted_checksums(m, sql_dir) else CHANGED

    return ([(m, versioned(m)) for m in files]
            + [(r, APPLIED if done_repeatable.get(r.key) == r.checksum else PENDING) for r in repeatable])
