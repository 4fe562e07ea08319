"""The archive manifest: what a month's archive holds (``DIR/YYYYMM/manifest.json``).

Value types and the reader of that one file; no database. Writing and verifying an
archive is ``engine.archive``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from composer_ops.core.runids import month_start
from composer_ops.errors import ComposerError

__all__ = ["FORMAT", "MANIFEST", "RENAMED_COLUMNS", "ArchiveKept", "BadArchive", "Manifest", "TableArchive",
           "current_column", "fewer_rows", "month_dir", "read_manifest"]

#: The manifest's ``format``: readers refuse any other.
FORMAT = "composer-archive/1"
MANIFEST = "manifest.json"


class BadArchive(ComposerError):
    """An archive that is missing, partial or does not match its manifest."""


class ArchiveKept(ComposerError):
    """A month not archived because the archive of it in place holds more rows of a
    table than the month now does (:func:`fewer_rows`): the old archive is kept."""


@dataclass(frozen=True, kw_only=True)
class TableArchive:
    """One table's file in an archive."""

    table: str
    partition: str
    file: str
    rows: int
    sha256: str                  # of the file's bytes
    content_sha256: str          # of the rows, in key order (engine.archive)
    fingerprint: str             # the database's (repo.archive.fingerprint) at export
    columns: list[dict[str, str]]


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What an archive holds; ``manifest.json``."""

    format: str
    month: str
    lower_bound: str
    upper_bound: str
    created_at: str
    schema_version: int
    tables: list[TableArchive] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)

    def table(self, name: str) -> TableArchive | None:
        return next((t for t in self.tables if t.table == name), None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT:
                raise BadArchive(f"{where}: format {doc.get('format')!r} is not {FORMAT!r}")
            tables = [TableArchive(**t) for t in doc.pop("tables")]
            for t in tables:
                # A file of the archive directory itself: never a path out of it.
                if not isinstance(t.file, str) or t.file != Path(t.file).name or t.file in ("", ".", ".."):
                    raise BadArchive(f"{where}: table {t.table!r} names the file {t.file!r}, which is not a file "
                                     "name in the archive's own directory")
            return cls(**doc, tables=tables)
        except BadArchive:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise BadArchive(f"{where}: not a readable archive manifest ({exc})") from None


def fewer_rows(old: Manifest, new: Manifest) -> str:
    """Why ``new`` must not replace ``old``, an archive of the same month in place: the
    first table of which it holds fewer rows, named with both counts; '' when it may (the
    same rows archived again, as a ``drop --archive`` run again after an interruption
    does, or more). A month emptied by a failed restore must never overwrite its only
    copy."""
    for entry in old.tables:
        now = new.table(entry.table)
        rows = now.rows if now is not None else 0
        if rows < entry.rows:
            return (f"the archive in place holds {entry.rows} rows of {entry.table}, the month now {rows}: "
                    "an archive is never replaced by one with fewer rows (restore the month from it, or archive "
                    "into another directory)")
    return ""


def month_dir(directory: Path, month: str) -> Path:
    """Where the archive of ``month`` (YYYYMM) lives under ``directory``."""
    month_start(month)   # Invalid unless YYYYMM
    return directory / month


def read_manifest(path: Path) -> Manifest:
    """The manifest of the archive directory ``path``; :class:`BadArchive` if there is
    none or it cannot be read."""
    file = Path(path) / MANIFEST
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadArchive(f"{path}: no {MANIFEST} (not an archive, or a partial one)") from None
    except OSError as exc:
        raise BadArchive(f"{file}: cannot read it ({exc})") from None
    return Manifest.from_json(text, file)


#: Columns renamed since an archive may have been written (V006): table -> {old spelling:
#: current name}. Restore and the archived run story read old archives by current names.
RENAMED_COLUMNS: Mapping[str, Mapping[str, str]] = {"task_instances": {"event_name": "signal_name"}}  # old spelling


def current_column(table: str, column: str) -> str:
    """The name ``column`` of ``table`` in an archive has in the current schema."""
    return RENAMED_COLUMNS.get(table, {}).get(column, column)
