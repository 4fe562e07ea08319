"""Partition archives: a month of the run tables as Parquet files plus a manifest,
verified by reading them back, and restored with COPY.

``DIR/YYYYMM/`` holds one Parquet file per run table and ``manifest.json`` (bounds,
schema version, and per table rows, file and content SHA-256 and the database's
fingerprint). A month is exported in one REPEATABLE READ snapshot into a hidden
directory, every file re-read and checked there, and only then moved into place, so a
crash never leaves a manifest over short files. A process killed on the way leaves a
hidden directory (``.YYYYMM.partial-*``, or ``.YYYYMM.old-*``: the archive it was
replacing, moved aside); the next export of the month tidies them up (:func:`_tidy`)
and nothing reads them as an archive. JSON and other non-native types are stored as the
text PostgreSQL prints, which COPY parses back unchanged.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from composer_ops import files
from composer_ops.core.actor import Actor
from composer_ops.core.cutoff import Cutoff
from composer_ops.core.manifest import (
    FORMAT,
    MANIFEST,
    ArchiveKept,
    BadArchive,
    Manifest,
    TableArchive,
    current_column,
    fewer_rows,
    month_dir,
    read_manifest,
)
from composer_ops.core.runids import month_bounds, month_start
from composer_ops.db import connect
from composer_ops.db.retry import db_retry
from composer_ops.engine.retention import misaligned
from composer_ops.errors import ComposerError, Invalid, NotFound
from composer_ops.repo import archive as repo
from composer_ops.repo import audit, partitions, retention
from composer_ops.repo._base import Conn, repeatable_read
from composer_ops.repo.archive import Column
from composer_ops.repo.partitions import RUN_TABLES

__all__ = ["Progress", "RestoreResult", "Restored", "archived_definitions", "column_specs", "content_fingerprint",
           "export_month", "read_rows", "refuse_missing_definitions", "restore_month", "restore_rows",
           "verify_month"]

log = logging.getLogger(__name__)

_BATCH = 5000


class Progress(Protocol):
    """What long work reports: a step with a known total, then advances."""

    def start(self, label: str, total: int) -> None: ...

    def advance(self, n: int) -> None: ...


class _Silent:
    def start(self, label: str, total: int) -> None:
        return None

    def advance(self, n: int) -> None:
        return None


def column_specs(entry: TableArchive) -> list[Column]:
    """The archived columns of ``entry`` as the repository describes columns."""
    return [Column(name=current_column(entry.table, c["name"]), type=c["type"]) for c in entry.columns]


# -- types -------------------------------------------------------------------------


def _arrow_type(col: Column) -> Any:
    import pyarrow as pa

    native = {
        "text": pa.string(), "character varying": pa.string(), "smallint": pa.int16(), "integer": pa.int32(),
        "bigint": pa.int64(), "boolean": pa.bool_(), "real": pa.float64(), "double precision": pa.float64(),
        "timestamp with time zone": pa.timestamp("us", tz="UTC"), "text[]": pa.list_(pa.string()),
    }
    return native.get(col.type, pa.string()) if not col.as_text else pa.string()


def _schema(cols: Sequence[Column]) -> Any:
    import pyarrow as pa

    return pa.schema([pa.field(c.name, _arrow_type(c), nullable=True,
                               metadata={"pg_type": c.type, "encoding": "text" if c.as_text else "native"})
                      for c in cols])


def _canonical(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return value


def _row_digest(digest: Any, row: Sequence[Any]) -> None:
    """Feed one row into ``digest`` in a form both the database's values and the
    values read back from Parquet produce identically."""
    digest.update(json.dumps([_canonical(v) for v in row], separators=(",", ":"), ensure_ascii=False,
                             default=str).encode())
    digest.update(b"\n")


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- export ------------------------------------------------------------------------


def export_month(conn: Conn, month: str, directory: Path, *, progress: Progress | None = None,
                 before_verify: Callable[[Path], None] | None = None,
                 on_exported: Callable[[Conn, Manifest], None] | None = None) -> Manifest:
    """Write ``month``'s partitions of every run table to ``directory/month`` and verify
    them; returns the manifest. One REPEATABLE READ transaction on ``conn`` reads
    everything; ``on_exported`` runs in it after the files are verified and in place
    (the caller's audit row), and the transaction commits after it. A month whose
    partitions do not exist is :class:`Invalid`; one whose archive in place holds more
    rows of a table than the month now does is :class:`ArchiveKept`, the archive in
    place untouched (:func:`~composer_ops.core.manifest.fewer_rows`). ``before_verify`` sees the files before
    they are verified (tests corrupt them there)."""
    shown = progress or _Silent()
    directory = Path(directory)
    target = month_dir(directory, month)
    directory.mkdir(parents=True, exist_ok=True)
    lower, upper = month_bounds(month)
    with conn.transaction():
        repeatable_read(conn)
        repo.pin_text_output(conn)
        if not repo.exists(conn, f"{RUN_TABLES[0]}_p{month}"):
            raise Invalid(f"month {month} has no partition {RUN_TABLES[0]}_p{month}: nothing to archive")
        version = repo.schema_version(conn)
        with _locked(directory):
            _tidy(directory, month)
            work = Path(tempfile.mkdtemp(prefix=f".{month}.partial-", dir=directory))
            held = _hold(work)          # until it is in place or removed: no tidying takes it for a leftover
        try:
            tables = [_export_table(conn, table, f"{table}_p{month}", work, shown) for table in RUN_TABLES]
            manifest = Manifest(format=FORMAT, month=month, lower_bound=lower, upper_bound=upper,
                                created_at=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
                                schema_version=version, tables=tables)
            (work / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
            if before_verify is not None:
                before_verify(work)
            verify_month(work, month=month, progress=shown)
            _sync(work)         # on disk before it takes the place of an archive a drop may rely on
            with _locked(directory):
                _tidy(directory, month)             # a run killed meanwhile may have moved the archive aside
                _refuse_fewer_rows(target, manifest)
                _move_into_place(work, target)
                _sync_directory(directory)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        finally:
            os.close(held)
        if on_exported is not None:
            on_exported(conn, manifest)
    return manifest


def _export_table(conn: Conn, table: str, partition: str, work: Path, progress: Progress) -> TableArchive:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # A run table without a partition for the month has no rows in it: archived empty,
    # with its parent's columns (the restore creates the partition).
    present = repo.exists(conn, partition)
    cols = repo.columns(conn, partition if present else table)
    key = repo.primary_key(conn, partition if present else table) or [c.name for c in cols]
    count, fingerprint = content_fingerprint(conn, partition)
    schema = _schema(cols)
    digest = hashlib.sha256()
    path = work / f"{table}.parquet"
    written = 0
    progress.start(f"{partition}: export", count)
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for rows in repo.stream_rows(conn, partition, cols, key) if present else ():
            for row in rows:
                _row_digest(digest, row)
            arrays = [pa.array(list(values), type=schema.field(i).type)
                      for i, values in enumerate(zip(*rows, strict=True))]
            writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
            written += len(rows)
            progress.advance(len(rows))
    if written != count:
        raise BadArchive(f"{partition}: counted {count} rows but read {written} in the same snapshot")
    return TableArchive(table=table, partition=partition, file=path.name, rows=written,
                        sha256=_file_sha256(path), content_sha256=digest.hexdigest(), fingerprint=fingerprint,
                        columns=[{"name": c.name, "type": c.type} for c in cols])


def content_fingerprint(conn: Conn, partition: str) -> tuple[int, str]:
    """:func:`repo.archive.fingerprint` of a partition; ``(0, "0")``, what an empty one
    gives, when it does not exist."""
    return repo.fingerprint(conn, partition) if repo.exists(conn, partition) else (0, "0")


def _refuse_fewer_rows(target: Path, manifest: Manifest) -> None:
    """:class:`ArchiveKept` when the archive at ``target`` (a manifest in place was
    verified before it was moved there) holds more rows of a table than ``manifest``."""
    try:
        old = read_manifest(target)
    except BadArchive:
        return                     # no archive there (nothing, or a partial one): nothing to keep
    reason = fewer_rows(old, manifest)
    if reason:
        raise ArchiveKept(f"{target}: {reason}")


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` of the archive directory: its entries change (a work
    directory made, an archive moved into place, leftovers tidied) only under it, so
    archive runs sharing a directory see each other's steps whole. Held for renames and
    listings only; a process that dies releases it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _hold(work: Path) -> int:
    """Lock the work directory of a live export (``flock``, released when the process
    ends, however it ends); its descriptor, to close once the export is over."""
    fd = os.open(work, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _abandoned(work: Path) -> bool:
    """Whether no live process holds ``work`` (:func:`_hold`): its export was killed."""
    try:
        fd = os.open(work, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _tidy(directory: Path, month: str) -> None:
    """Under :func:`_locked`: clear what export runs of ``month`` killed on the way left.
    A ``.YYYYMM.old-*`` is an archive that was in place, moved aside by a replacement
    that never moved in: put back when nothing is in place (the newest, if several),
    removed otherwise, as the replacement would have. A ``.YYYYMM.partial-*`` that no
    live export holds is removed: it was never verified."""
    target = month_dir(directory, month)
    aside = sorted(directory.glob(f".{month}.old-*"), key=_created_at, reverse=True)
    for old in aside:
        if target.exists():
            _remove(old)
        else:
            os.replace(old, target)
            log.warning("archive of %s: put back %s, which a killed archive run had moved aside to %s",
                        month, target, old.name)
    for work in directory.glob(f".{month}.partial-*"):
        if _abandoned(work):
            _remove(work)


def _remove(path: Path) -> None:
    """Remove an archive directory, or a link or file found in its place (a link is
    removed, never what it points to)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def _created_at(path: Path) -> str:
    """When the archive at ``path`` was written, by its manifest ('' when unreadable)."""
    try:
        return read_manifest(path).created_at
    except BadArchive:
        return ""


def _sync(work: Path) -> None:
    """Flush every file of ``work`` and the directory itself to disk (``fsync``): a
    verified archive read back from the page cache is not yet one a power loss keeps,
    and ``partitions drop --archive`` drops the month once it verifies."""
    for path in sorted(work.iterdir()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _sync_directory(work)


def _sync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries (the renames into it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(work: Path, target: Path) -> None:
    """Replace ``target`` with the verified ``work`` directory (a rename each way; a
    kill between them leaves the old archive aside for :func:`_tidy` to put back)."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(work, target)
    if old is not None:
        with contextlib.suppress(OSError):
            _remove(old)


# -- verification and reading --------------------------------------------------------


def verify_month(path: Path, *, month: str | None = None, progress: Progress | None = None) -> Manifest:
    """Check an archive directory against its manifest: every run table present, each
    file's bytes match its SHA-256, and its rows, read back, match the row count and
    the content hash recorded at export. Returns the manifest; :class:`BadArchive`
    says what does not match."""
    shown = progress or _Silent()
    path = Path(path)
    manifest = read_manifest(path)
    if month is not None and manifest.month != month:
        raise BadArchive(f"{path}: the manifest is for month {manifest.month}, not {month}")
    missing = [t for t in RUN_TABLES if manifest.table(t) is None]
    if missing:
        raise BadArchive(f"{path}: the manifest has no {', '.join(missing)}")
    for entry in manifest.tables:
        file = path / entry.file
        if not file.is_file():
            raise BadArchive(f"{file}: missing")
        if _file_sha256(file) != entry.sha256:
            raise BadArchive(f"{file}: its SHA-256 does not match the manifest (changed or truncated)")
        digest = hashlib.sha256()
        n = 0
        shown.start(f"{entry.partition}: verify", entry.rows)
        for rows in read_rows(path, entry):
            for row in rows:
                _row_digest(digest, row)
            n += len(rows)
            shown.advance(len(rows))
        if n != entry.rows:
            raise BadArchive(f"{file}: {n} rows read back, the manifest says {entry.rows}")
        if digest.hexdigest() != entry.content_sha256:
            raise BadArchive(f"{file}: the rows read back differ from the rows exported")
    return manifest


def read_rows(path: Path, entry: TableArchive, *, batch: int = _BATCH) -> Iterator[list[tuple[Any, ...]]]:
    """The rows of one archived table, in file (key) order, in the manifest's column
    order; :class:`BadArchive` when the file cannot be parsed or its columns differ."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = Path(path) / entry.file
    names = [c["name"] for c in entry.columns]
    try:
        reader = pq.ParquetFile(file)
        if reader.schema_arrow.names != names:
            raise BadArchive(f"{file}: columns {reader.schema_arrow.names} differ from the manifest's {names}")
        with contextlib.closing(reader):
            for rb in reader.iter_batches(batch_size=batch):
                cols = [rb.column(i).to_pylist() for i in range(rb.num_columns)]
                yield list(zip(*cols, strict=True)) if cols else []
    except BadArchive:
        raise
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise BadArchive(f"{file}: cannot be read as Parquet ({exc})") from None


# -- restore -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Restored:
    """What restoring one table of a month did: rows copied, and whether the
    database's fingerprint of them equals the one taken at export (None when the
    table's columns changed since, so only the count could be compared)."""

    table: str
    partition: str
    rows: int
    fingerprint_matches: bool | None


def archived_definitions(path: Path, manifest: Manifest) -> list[tuple[str, int]]:
    """The definition versions the runs of a verified archive are of (two columns of its
    runs file), in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    entry = manifest.table("workflow_runs")
    assert entry is not None    # verify_month checked
    file = Path(path) / entry.file
    try:
        runs = pq.read_table(file, columns=["workflow_definition_id", "workflow_version"])
    except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
        raise BadArchive(f"{file}: its runs' definition columns cannot be read ({exc})") from None
    return sorted(set(zip(runs.column(0).to_pylist(), runs.column(1).to_pylist(), strict=True)))


def refuse_missing_definitions(conn: Conn, month: str, named: Sequence[tuple[str, int]]) -> None:
    """:class:`Invalid` when runs of the archive of ``month`` are of a definition version
    (``named``: :func:`archived_definitions`) the database does not hold: their events
    could not load it (nothing deletes one; a version deleted by hand in SQL)."""
    missing = repo.missing_definitions(conn, named)
    if missing:
        listed = ", ".join(f"{wf!r} v{version}" for wf, version in missing[:5])
        raise Invalid(f"the archive of {month} holds runs of workflow definition versions this database "
                      f"does not hold ({listed}{', ...' if len(missing) > 5 else ''}); put those "
                      "workflow_definitions rows back (from a backup), then restore")


def restore_rows(conn: Conn, path: Path, manifest: Manifest, *, progress: Progress | None = None) -> list[Restored]:
    """COPY a verified archive's rows into its month's partitions, which must exist and
    be empty, in the caller's transaction (tables in foreign-key order), then check
    every table against the manifest: the row count, and the database's fingerprint
    when the table has the archived columns exactly. A mismatch raises
    :class:`BadArchive` (the caller's transaction must then roll back). The definitions
    of its runs were checked before (:func:`restore_month`)."""
    shown = progress or _Silent()
    repo.pin_text_output(conn)
    done: list[Restored] = []
    for table in RUN_TABLES:
        entry = manifest.table(table)
        assert entry is not None    # verify_month checked
        partition = f"{table}_p{manifest.month}"
        current = {c.name: c.type for c in repo.columns(conn, partition)}
        archived = column_specs(entry)
        for col in archived:
            if col.name not in current:
                raise Invalid(f"{partition} has no column {col.name!r}, which the archive holds "
                              f"(archived at schema version {manifest.schema_version}); restore needs a schema "
                              "with every archived column")
            if current[col.name] != col.type:
                raise Invalid(f"{partition}.{col.name} is {current[col.name]}, the archive's is {col.type}")
        present = repo.row_count(conn, partition)
        if present:
            raise ComposerError(f"{partition} already holds {present} rows; restore fills only a month that was "
                                "dropped (or is empty)")
        shown.start(f"{partition}: restore", entry.rows)

        def rows(entry: TableArchive = entry) -> Iterator[tuple[Any, ...]]:
            for batch in read_rows(path, entry):
                yield from batch
                shown.advance(len(batch))

        n = repo.copy_rows(conn, partition, [c.name for c in archived], rows())
        count, fingerprint = repo.fingerprint(conn, partition)
        same_columns = list(current) == [c.name for c in archived]
        if count != entry.rows or n != entry.rows:
            raise BadArchive(f"{partition}: {count} rows after restore, the archive holds {entry.rows}")
        if same_columns and fingerprint != entry.fingerprint:
            raise BadArchive(f"{partition}: the restored rows differ from the rows archived "
                             "(the database's fingerprints do not match)")
        done.append(Restored(table=table, partition=partition, rows=n,
                             fingerprint_matches=(fingerprint == entry.fingerprint) if same_columns else None))
    return done


@dataclass(frozen=True, kw_only=True)
class RestoreResult:
    """What ``partitions restore`` did (or, with ``applied`` false, would do)."""

    month: str
    source: str
    tables: list[Restored]
    applied: bool
    duplicate: bool = False        # an earlier attempt of this request committed; its record was read back

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)


def _months_held(directory: Path) -> str:
    """What an archive directory holds, for the error naming a month it does not."""
    held = sorted(p.name for p in directory.glob("[0-9]" * 6) if (p / MANIFEST).is_file()) if directory.is_dir() else []
    return f"it holds {', '.join(held)}" if held else "it holds no month's archive"


def restore_month(url: str | None, month: str, directory: Path, *, yes: bool, actor: Actor | None = None,
                  lock_timeout_s: float = 2.0, progress: Progress | None = None,
                  request_id: str | None = None) -> RestoreResult:
    """Restore ``month`` from its archive under ``directory``: verify the archive (every
    file re-read), then, with ``yes``, create the month's partitions where missing (a
    short transaction of its own, so nothing queues behind the copy), and COPY every
    table in one transaction that also checks the rows against the manifest and writes
    the audit row. When the copy fails, the partitions this call created are dropped
    again if they are still empty: empty partitions left behind would look like an
    empty month to the next ``drop --archive``. Without ``yes`` nothing is written: the
    result says what would be restored. Partitions holding rows are refused
    (:class:`ComposerError`), and so are runs of a definition version the database does
    not hold (:class:`Invalid`), with ``yes`` or without."""
    if lock_timeout_s <= 0:
        raise Invalid(f"lock timeout must be more than 0 seconds, got {lock_timeout_s:g}")
    path = month_dir(Path(directory), month)
    if not path.exists():      # a wrong month or directory (bad input); a partial one stays BadArchive
        aside = sorted(Path(directory).glob(f".{month}.old-*"))
        kept = (f"; {aside[0]} is the archive of it a killed archive run was replacing: run `partitions archive` "
                "of the month again to put it back in place") if aside else ""
        raise NotFound(f"no archive of month {month} under {directory} (no {path}); "
                       f"{_months_held(Path(directory))}{kept}")
    manifest = verify_month(path, month=month, progress=progress)
    planned = [Restored(table=t.table, partition=t.partition, rows=t.rows, fingerprint_matches=None)
               for t in manifest.tables]
    # Before the month's partitions are made. Nothing locks a definition's row (V019):
    # checked once, as a hand-run DELETE could come after any check.
    absent = _refuse_before(url, manifest.month, archived_definitions(path, manifest), planned if not yes else [],
                            acting=yes)
    if not yes:
        return RestoreResult(month=month, source=str(path), tables=planned, applied=False)
    request = request_id or uuid.uuid4().hex
    _create_month(url, month, lock_timeout_s)
    try:
        return _copy_month(url, path, manifest, actor, lock_timeout_s, progress, request)
    except BaseException as exc:
        left = _drop_created(url, month, absent, lock_timeout_s)
        if left and isinstance(exc, ComposerError):
            failed = ComposerError(f"{exc}; {left}")
            failed.exit_code = exc.exit_code
            raise failed from exc
        raise


def _drop_created(url: str | None, month: str, created: list[str], lock_timeout_s: float) -> str:
    """Drop the partitions a failed restore created (``created``) that are still empty;
    what could not be done, or ''."""
    if not created:
        return ""
    try:
        kept = _drop_if_empty(url, month, created, lock_timeout_s)
    except ComposerError as exc:
        return (f"the empty partitions it created ({', '.join(created)}) could not be dropped again ({exc}); "
                "run the restore again to fill them")
    return f"{', '.join(kept)} hold rows now and were kept" if kept else ""


# Each attempt of these opens a connection of its own: a retry after a lost
# connection must not run on the dead one.

@db_retry(max_attempts=5, base=0.25, cap=4.0)
def _refuse_before(url: str | None, month: str, named: Sequence[tuple[str, int]],
                   filled: list[Restored], *, acting: bool = False) -> list[str]:
    """What a restore refuses before it writes: a role that may not restore (``acting``),
    ``filled``'s partitions holding rows (the dry run's check), runs of a definition
    version the database does not hold. Returns the month's partitions that do not exist
    (the restore creates them)."""
    with connect(url, application_name="composer-ops partitions restore") as conn:
        if acting:
            audit.require_record(conn, "partitions restore")
        for t in filled:
            if repo.exists(conn, t.partition) and (n := repo.row_count(conn, t.partition)):
                raise ComposerError(f"{t.partition} already holds {n} rows; restore fills only a month that "
                                    "was dropped (or is empty)")
        refuse_missing_definitions(conn, month, named)
        return [p for p in (f"{t}_p{month}" for t in RUN_TABLES) if not repo.exists(conn, p)]


@db_retry(max_attempts=5, base=0.25, cap=4.0)
def _create_month(url: str | None, month: str, lock_timeout_s: float) -> None:
    with connect(url, application_name="composer-ops partitions restore") as conn, conn.transaction():
        partitions.set_lock_timeout(conn, lock_timeout_s)
        partitions.ensure_from(conn, month_start(month).date(), 0)


@db_retry(max_attempts=3, base=0.25, cap=4.0)
def _drop_if_empty(url: str | None, month: str, created: list[str], lock_timeout_s: float) -> list[str]:
    """Drop the partitions of ``created`` that exist, unless one of them holds rows (a
    copy that committed after all); returns those holding rows. Under the partition
    advisory lock (a restore's copy holds it) and the partitions' own locks."""
    with connect(url, application_name="composer-ops partitions restore") as conn, conn.transaction():
        partitions.set_lock_timeout(conn, lock_timeout_s)
        retention.lock_partitions(conn)
        present = [p for p in created if repo.exists(conn, p)]
        if not present:
            return []
        retention.lock_tables(conn, present)
        holding = [p for p in present if repo.row_count(conn, p)]
        if not holding:
            repo.remove_month(conn, month, [t for t in RUN_TABLES if f"{t}_p{month}" in present], keep_table=False)
        return holding


@db_retry(max_attempts=5, base=0.25, cap=4.0)
def _copy_month(url: str | None, path: Path, manifest: Manifest, actor: Actor | None, lock_timeout_s: float,
                progress: Progress | None, request: str) -> RestoreResult:
    """The COPY and its audit row, under the partition advisory lock, taken before
    looking for the request's audit row: an earlier attempt still committing holds it."""
    with connect(url, application_name="composer-ops partitions restore") as conn, conn.transaction():
        partitions.set_lock_timeout(conn, lock_timeout_s)
        retention.lock_partitions(conn)
        earlier = audit.of_request(conn, request)
        if earlier:
            rows = (earlier[0].counts or {}).get("tables") or {}
            matches = (earlier[0].detail or {}).get("fingerprints_match") or {}
            tables = [Restored(table=t, partition=f"{t}_p{manifest.month}", rows=int(rows[t]),
                               fingerprint_matches=matches.get(t)) for t in RUN_TABLES if t in rows]
            return RestoreResult(month=manifest.month, source=str(path), tables=tables, applied=True,
                                 duplicate=True)
        done = restore_rows(conn, path, manifest, progress=progress)
        audit.record(conn, "partitions restore", actor=actor, target=manifest.month, request=request,
                     counts={"rows": sum(t.rows for t in done), "tables": {t.table: t.rows for t in done}},
                     detail={"from": str(path), "schema_version": manifest.schema_version,
                             "fingerprints_match": {t.table: t.fingerprint_matches for t in done}})
    return RestoreResult(month=manifest.month, source=str(path), tables=done, applied=True)


# -- archiving what retention would drop ----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MonthArchived:
    """One month ``partitions archive`` wrote (or, on a dry run, would write)."""

    month: str
    path: str
    partitions: list[str]
    rows: int                       # exact when written, the plan's estimate on a dry run
    written: bool
    refused: str = ""               # why it was not written (ArchiveKept)


@dataclass(frozen=True, kw_only=True)
class ArchiveResult:
    cutoff: datetime
    months: list[MonthArchived]
    kept: list[tuple[str, str]]     # (month, reason) the plan keeps


def archive_due(url: str | None, older_than: datetime | str | Cutoff, directory: Path, *, dry_run: bool = False,
                actor: Actor | None = None, progress: Progress | None = None) -> ArchiveResult:
    """Archive every month retention would drop for ``older_than`` (the same plan) into
    ``directory``, one month at a time, each verified before it is reported, with an
    audit row per month. ``dry_run`` only lists them."""
    directory = Path(directory)
    with connect(url, application_name="composer-ops partitions archive") as conn:
        with conn.transaction():
            if not dry_run:
                audit.require_record(conn, "partitions archive")    # before any file or directory is written
            plan = retention.plan(conn, older_than)      # the one `partitions drop` follows
            cutoff, due, kept = plan.cutoff, plan.due, plan.kept
        done: list[MonthArchived] = [
            MonthArchived(month=m.month, path=str(month_dir(directory, m.month)), partitions=list(m.partitions),
                          rows=m.rows, written=False, refused=m.reason) for m in misaligned(plan.months)]
        if not dry_run:
            check_directory(directory)
        for month in due:
            target = month_dir(directory, month.month)
            if dry_run:
                done.append(MonthArchived(month=month.month, path=str(target), partitions=list(month.partitions),
                                          rows=month.rows, written=False))
                continue
            try:
                manifest = export_month(conn, month.month, directory, progress=progress,
                                        on_exported=partial(_audit_archive, actor=actor, target=target))
            except ArchiveKept as exc:      # the other months go on
                done.append(MonthArchived(month=month.month, path=str(target), partitions=list(month.partitions),
                                          rows=month.rows, written=False, refused=str(exc)))
                continue
            except KeyboardInterrupt:       # the months written are kept: say which
                written = [m.month for m in done if m.written]
                raise KeyboardInterrupt(f"month {month.month} was not archived; archived before it: "
                                        f"{', '.join(written) or 'none'}; run it again to go on") from None
            done.append(MonthArchived(month=month.month, path=str(target), partitions=list(month.partitions),
                                      rows=manifest.rows, written=True))
    return ArchiveResult(cutoff=cutoff, months=sorted(done, key=lambda m: m.month), kept=kept)


def _audit_archive(conn: Conn, manifest: Manifest, *, actor: Actor | None, target: Path) -> None:
    audit.record(conn, "partitions archive", actor=actor, target=manifest.month,
                 counts={"rows": manifest.rows, "tables": {t.table: t.rows for t in manifest.tables}},
                 detail={"to": str(target), "schema_version": manifest.schema_version,
                         "files": {t.file: t.sha256 for t in manifest.tables}})


def check_directory(directory: Path) -> None:
    """The archive directory can be created and written, before any month is read."""
    files.check_directory(directory, "archive directory")
