"""Retention one month at a time, keeping the month: ``partitions drop --archive DIR``
(drop a month only once its archive verified) and ``partitions detach``.

Months are the retention plan's, oldest first. Each is archived and verified without a
writer's lock; then one transaction with ``lock_timeout`` takes the partition advisory
lock and the month's partitions, judges the month again, checks its rows against the
archive's fingerprints, drops or detaches it and writes the audit row. A month that
fails a check stops the command. A retry takes the advisory lock first, then finds its
own audit row. Detach is refused on Citus (:data:`CITUS_DETACH_REFUSED`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from composer_ops.core.actor import Actor
from composer_ops.core.cutoff import Cutoff
from composer_ops.core.manifest import ArchiveKept, BadArchive, Manifest, month_dir
from composer_ops.db import connect
from composer_ops.db.retry import backoff_delay
from composer_ops.engine.archive import Progress, content_fingerprint, export_month
from composer_ops.engine.retention import BLOCKED_REASONS, misaligned
from composer_ops.errors import ComposerError, Invalid, Transient
from composer_ops.repo import archive as repo
from composer_ops.repo import audit, citus, locks, partitions, retention
from composer_ops.repo.partitions import RUN_TABLES
from composer_ops.repo.rows import RetentionMonth

__all__ = ["MonthRetired", "RetireResult", "retire_months"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MonthRetired:
    """What happened to one month the plan would drop."""

    month: str
    outcome: str                     # "dropped" | "detached" | "kept" (judged again under its locks) | "refused"
    reason: str = ""                 # why it was kept or refused
    partitions: list[str] = field(default_factory=list)
    rows: int = 0                    # exact when archived or refused, else the plan's estimate
    estimated: bool = False          # ``rows`` is the catalog's estimate (a detach), not a count
    archive: str | None = None
    duplicate: bool = False


@dataclass(frozen=True, kw_only=True)
class RetireResult:
    cutoff: datetime
    plan: list[RetentionMonth]
    months: list[MonthRetired]
    applied: bool

    @property
    def blocked(self) -> list[RetentionMonth]:
        """Months past the cut-off kept because runs in them are still active."""
        return [m for m in self.plan if m.action == "keep" and m.reason in BLOCKED_REASONS]


#: Why ``partitions detach`` refuses a Citus database (before it plans or changes anything).
#: Citus names the foreign key of each shard of a month's partition after the shard of
#: the parent it was cloned from, and propagates a DROP CONSTRAINT under the partition's
#: own shard names, so the detached month's key cannot be dropped ("constraint
#: task_instances_run_id_fkey_<n> ... does not exist", Citus 13.2); with the key kept, the
#: month of workflow_runs cannot be detached after it. tests/citus/test_retire.py.
CITUS_DETACH_REFUSED = ("partitions detach is not supported on Citus: Citus cannot drop the detached month's "
                        "foreign keys on its shards; use `partitions drop --archive DIR` (restore with "
                        "`partitions restore`)")


def retire_months(url: str | None, older_than: datetime | str | Cutoff, *, archive_dir: Path | None = None,
                  keep_table: bool = False, yes: bool = False, actor: Actor | None = None,
                  lock_timeout_s: float = 2.0, max_attempts: int = 5, progress: Progress | None = None,
                  request_id: str | None = None) -> RetireResult:
    """Drop (after archiving into ``archive_dir``, when given) or, with ``keep_table``,
    detach every month the retention plan marks 'drop'; see the module. Without
    ``yes`` nothing is written: the result holds the plan."""
    if lock_timeout_s <= 0 or max_attempts < 1:
        raise Invalid(f"lock timeout must be > 0 and attempts >= 1, got {lock_timeout_s}s and {max_attempts}")
    if archive_dir is None and not keep_table:
        raise Invalid("give an archive directory, or keep the months as tables (detach)")
    request = request_id or uuid.uuid4().hex
    with connect(url, application_name="composer-ops partitions retire") as conn:
        with conn.transaction():
            if keep_table and citus.is_citus(conn):
                raise Invalid(CITUS_DETACH_REFUSED)
            if yes:
                audit.require_record(conn, "partitions detach" if keep_table else "partitions drop")
            judged = retention.plan(conn, older_than)
            copies = {m.month: repo.detached_copies(conn, m.month, RUN_TABLES) for m in judged.due} \
                if keep_table else {}
            held = {month: _month_rows(conn, month) for month, named in copies.items() if named}
        plan, cutoff, due = judged.months, judged.cutoff, judged.due
        refused = [MonthRetired(month=m.month, outcome="refused", reason=m.reason, partitions=list(m.partitions),
                                rows=m.rows, estimated=True) for m in misaligned(plan)]
        if not yes:
            return RetireResult(cutoff=cutoff, plan=plan, applied=False, months=_by_month(refused, [
                MonthRetired(month=m.month, outcome="refused", reason=_copies_refused(copies[m.month]),
                             partitions=list(m.partitions), rows=held[m.month])
                if copies.get(m.month) else
                MonthRetired(month=m.month, outcome="would detach" if keep_table else "would drop",
                             partitions=list(m.partitions), rows=m.rows, estimated=True,
                             archive=str(month_dir(archive_dir, m.month)) if archive_dir else None) for m in due]))
        done: list[MonthRetired] = []
        for month in due:
            manifest = None
            if archive_dir is not None:
                try:
                    manifest = export_month(conn, month.month, archive_dir, progress=progress,
                                            on_exported=lambda c, m: _audit_archived(c, m, actor, archive_dir))
                except ArchiveKept as exc:      # refused; the other months go on
                    done.append(MonthRetired(month=month.month, outcome="refused", reason=str(exc),
                                             partitions=list(month.partitions), rows=month.rows))
                    continue
                except BadArchive as exc:
                    raise BadArchive(f"month {month.month} was not dropped: its archive did not verify ({exc})"
                                     + _so_far(done)) from exc
                except KeyboardInterrupt:       # while archiving: the month is still there
                    raise KeyboardInterrupt(f"month {month.month} was being archived, not dropped"
                                            f"{_so_far(done)}; run it again to go on") from None
            try:
                done.append(_retire(url, month.month, cutoff, manifest, archive_dir, keep_table, actor,
                                    f"{request}:{month.month}", lock_timeout_s, max_attempts))
            except BadArchive as exc:
                raise BadArchive(f"{exc}{_so_far(done)}") from exc
            except KeyboardInterrupt:
                raise KeyboardInterrupt(_interrupted_at(month.month, keep_table, done)) from None
    return RetireResult(cutoff=cutoff, plan=plan, months=_by_month(refused, done), applied=True)


def _by_month(*parts: list[MonthRetired]) -> list[MonthRetired]:
    return sorted((m for part in parts for m in part), key=lambda m: m.month)


def _copies_refused(copies: list[str]) -> str:
    shown = ", ".join(copies[:4]) + (f" and {len(copies) - 4} more" if len(copies) > 4 else "")
    return (f"a detached copy of the month is already in {repo.DETACHED_SCHEMA} ({shown}): "
            "drop it, or move it to another schema, first; nothing of this month was changed")


def _interrupted_at(month: str, keep_table: bool, done: list[MonthRetired]) -> str:
    """What an interrupt while ``month`` was being dropped (or detached) leaves: that month
    as it was or gone (its transaction committed or not), and the months done before it."""
    verb = "detached" if keep_table else "dropped"
    return (f"month {month} was being {verb} (`partitions list` says whether it was){_so_far(done)}; "
            "run it again to go on")


def _so_far(done: list[MonthRetired]) -> str:
    gone = [m.month for m in done if m.outcome in ("dropped", "detached")]
    return f"; done before it: {', '.join(gone)}" if gone else "; no month was dropped"


def _audit_archived(conn: psycopg.Connection[Any], manifest: Manifest, actor: Actor | None, directory: Path) -> None:
    audit.record(conn, "partitions archive", actor=actor, target=manifest.month,
                 counts={"rows": manifest.rows, "tables": {t.table: t.rows for t in manifest.tables}},
                 detail={"to": str(month_dir(directory, manifest.month)), "schema_version": manifest.schema_version,
                         "files": {t.file: t.sha256 for t in manifest.tables}})


def _retire(url: str | None, month: str, cutoff: datetime, manifest: Manifest | None, archive_dir: Path | None,
            keep_table: bool, actor: Actor | None, request: str, lock_timeout_s: float,
            max_attempts: int) -> MonthRetired:
    """One month's transaction, tried again with backoff when its locks stay busy or
    its connection is lost."""
    attempts = 0
    while True:
        attempts += 1
        try:
            with _fresh(url) as conn:
                return _retire_once(conn, month, cutoff, manifest, archive_dir, keep_table, actor, request,
                                    lock_timeout_s)
        except Transient as exc:
            if attempts >= max_attempts:
                if isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):
                    holders = locks.holders_text_on(_fresh(url), partitions.RUN_TABLES)
                    raise ComposerError(
                        f"month {month}: could not lock its partitions within {lock_timeout_s:g}s in {attempts} "
                        f"attempts ({holders}); it was not {'detached' if keep_table else 'dropped'}, "
                        "try again later") from exc
                raise
            delay = backoff_delay(attempts - 1, base=0.25, cap=4.0)
            log.warning("month %s: attempt %d failed (%s); retrying in %.2fs", month, attempts, exc, delay)
            time.sleep(delay)


@contextlib.contextmanager
def _fresh(url: str | None) -> Iterator[psycopg.Connection[Any]]:
    with connect(url, application_name="composer-ops partitions retire") as conn:
        yield conn



def _retire_once(conn: psycopg.Connection[Any], month: str, cutoff: datetime, manifest: Manifest | None,
                 archive_dir: Path | None, keep_table: bool, actor: Actor | None, request: str,
                 lock_timeout_s: float) -> MonthRetired:
    action = "partitions detach" if keep_table else "partitions drop"
    outcome = "detached" if keep_table else "dropped"
    archive = str(month_dir(archive_dir, month)) if archive_dir is not None else None
    with conn.transaction():
        partitions.set_lock_timeout(conn, lock_timeout_s)
        retention.lock_partitions(conn)     # first: an earlier attempt still committing holds it
        earlier = audit.of_request(conn, request)
        if earlier:
            detail = earlier[0].detail or {}
            counts = earlier[0].counts or {}
            return MonthRetired(month=month, outcome=outcome, partitions=list(detail.get("partitions", [])),
                                rows=int(counts.get("rows", counts.get(audit.ESTIMATED_ROWS, 0))),
                                estimated=audit.ESTIMATED_ROWS in counts, archive=archive, duplicate=True)
        first = _judged(conn, cutoff, month)
        if first is None or first.action != "drop":
            return MonthRetired(month=month, outcome="kept", reason=first.reason if first else "no longer exists")
        if keep_table and (copies := repo.detached_copies(conn, month, RUN_TABLES)):
            return MonthRetired(month=month, outcome="refused", reason=_copies_refused(copies),
                                partitions=list(first.partitions), rows=_month_rows(conn, month))
        # SHARE while the month is judged and its rows compared: no writer gets in, and
        # readers (the coordinator's scans) go on, so none of them holds the run tables
        # while waiting for the month when the drop asks for the tables below.
        retention.lock_months(conn, [first], exclusive=False)
        judged = _judged(conn, cutoff, month)     # a new snapshot, taken under the month's locks
        if judged is None or judged.action != "drop":
            return MonthRetired(month=month, outcome="kept", reason=judged.reason if judged else "no longer exists")
        rows = judged.rows
        if manifest is not None:
            repo.pin_text_output(conn)
            for entry in manifest.tables:
                count, fingerprint = content_fingerprint(conn, entry.partition)
                if (count, fingerprint) != (entry.rows, entry.fingerprint):
                    raise BadArchive(f"month {month} was not dropped: {entry.partition} changed after it was "
                                     f"archived ({count} rows now, {entry.rows} archived); archive it again")
            rows = manifest.rows
        retention.lock_months(conn, [judged])    # the run tables, then the month: ACCESS EXCLUSIVE
        handled = repo.remove_month(conn, month, RUN_TABLES, keep_table=keep_table)
        if not keep_table:
            retention.record(conn, request, cutoff, [judged])
        # Without an archive the rows are the plan's estimate: counting them here would
        # scan the whole month under the locks that hold every writer of the run tables.
        estimated = manifest is None
        audit.record(conn, action, actor=actor, target=month, request=request,
                     counts={audit.ESTIMATED_ROWS if estimated else "rows": rows, "bytes": judged.bytes,
                             "partitions": len(handled)},
                     detail={"cutoff": cutoff.isoformat(), "partitions": handled, "archive": archive,
                             "schema": repo.DETACHED_SCHEMA if keep_table else None})
    return MonthRetired(month=month, outcome=outcome, partitions=handled, rows=rows, estimated=estimated,
                        archive=archive)


def _month_rows(conn: psycopg.Connection[Any], month: str) -> int:
    """The rows ``month``'s partitions hold, counted (what a refused month reports)."""
    return sum(repo.row_count(conn, p) for p in (f"{t}_p{month}" for t in RUN_TABLES) if repo.exists(conn, p))


def _judged(conn: psycopg.Connection[Any], cutoff: datetime, month: str) -> RetentionMonth | None:
    return next((m for m in retention.plan(conn, cutoff).months if m.month == month), None)
