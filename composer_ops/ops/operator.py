"""What operators need beside the analytics: runs found by their input, the workers
registry, the audit of operator actions, the command that unblocks a month, and a run
read back from a partition archive once its month was dropped.

Each function reads only (the archive functions read files, not the database); the
actions themselves are ``composer-ops`` commands, which these name.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import polars as pl

from composer_ops.core.cutoff import Cutoff
from composer_ops.core.runids import month_of, month_start
from composer_ops.errors import Invalid, NotFound
from composer_ops.ops._common import UTC_TS, Source, connection, rows_frame
from composer_ops.ops.investigation import HISTORY_SCHEMA, TASK_SCHEMA, RunStory, definition_graph, validate_run_id
from composer_ops.repo import analytics, audit, retention, runs, workers
from composer_ops.repo.audit import AuditCommand

__all__ = ["AUDIT_LIMIT", "RUNS_SCHEMA", "archived_run_story", "audit_commands", "audit_log", "definition_spec",
           "find_runs", "unblock_command", "workers_frame"]

#: The most commands one ``audit list`` shows.
AUDIT_LIMIT = 10_000

RUNS_SCHEMA = {
    "run_id": pl.String, "workflow_id": pl.String, "workflow_version": pl.Int64, "status": pl.String,
    "created_at": UTC_TS, "completed_at": UTC_TS, "input": pl.String, "error": pl.String,
}


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def find_runs(source: Source = None, *, workflow: str | None = None, status: str | Sequence[str] | None = None,
              since: datetime | str | None = None, until: datetime | str | None = None,
              where: str | Mapping[str, Any] | None = None, limit: int = 50) -> pl.DataFrame:
    """Runs as ``composer-ops runs list`` finds them (the same selection, checked before
    any query): newest first, at most ``limit``."""
    from composer_ops.core.selection import check_limit, selection

    chosen = selection(workflow=workflow, status=status, since=since, until=until, where=where)
    check_limit(limit)
    with connection(source) as conn:
        found = runs.find_runs(conn, chosen.resolve(partial(retention.resolve, conn)), limit=limit)
    return rows_frame([(r.id, r.workflow_id, r.workflow_version, r.status, r.created_at, r.completed_at,
                        _json(r.input), _json(r.error)) for r in found], RUNS_SCHEMA)


def workers_frame(source: Source = None, *, window_h: float = 24.0) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The workers registry as ``composer-ops workers list`` shows it: every worker seen
    in the last ``window_h`` hours (0: all) or still holding a lease, with its state
    ('live', 'dead', 'stopped'), and the RUNNING tasks leased to workers that are not
    live (what a dead worker left behind)."""
    with connection(source) as conn:
        found = workers.list_workers(conn, window_s=None if not window_h else window_h * 3600)
        left = workers.leases_of(conn, [w.id for w in found if w.state != "live" and w.running])
    registry = rows_frame([(w.id, w.state, w.host, w.pid, w.queues, w.concurrency, w.running, w.expired,
                            w.started_at, w.last_seen_at, w.silent_s, w.stopped_at) for w in found], {
        "worker": pl.String, "state": pl.String, "host": pl.String, "pid": pl.Int64, "queues": pl.List(pl.String),
        "concurrency": pl.Int64, "leases": pl.Int64, "expired": pl.Int64, "started_at": UTC_TS,
        "last_seen_at": UTC_TS, "silent_s": pl.Float64, "stopped_at": UTC_TS})
    leases = rows_frame([(x.lease_owner, x.run_id, x.node_id, x.task_id, x.attempt, x.lease_expires_at, x.expired)
                         for x in left], {
        "worker": pl.String, "run_id": pl.String, "node_id": pl.String, "task_id": pl.String, "attempt": pl.Int64,
        "lease_expires_at": UTC_TS, "expired": pl.Boolean})
    return registry, leases


def audit_commands(source: Source = None, *, since: datetime | Cutoff | None = None,
                   actions: list[str] | None = None, limit: int = 50) -> list[AuditCommand]:
    """The newest ``limit`` operator commands first, each with every audit row it wrote
    (a bulk cancel writes one per chunk): from ``since`` (an instant, or a cut-off such
    as ``7d`` counted back from the database clock) on, of the given ``actions``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= AUDIT_LIMIT:
        raise Invalid(f"limit must be an integer from 1 to {AUDIT_LIMIT}, got {limit!r}")
    unknown = sorted(set(actions or ()) - set(audit.ACTIONS))
    if unknown:
        raise Invalid(f"unknown action {', '.join(map(repr, unknown))}: the actions are {', '.join(audit.ACTIONS)}")
    with connection(source) as conn:
        instant = since if since is None or isinstance(since, datetime) else retention.resolve(conn, since)
        return audit.commands(conn, since=instant, actions=actions or None, limit=limit)


def audit_log(source: Source = None, *, limit: int = 100) -> pl.DataFrame:
    """The newest operator commands first, one row each however many transactions it
    took (a bulk cancel in 100 chunks is one row): when it last wrote, its action(s),
    on what, the counts added up, how many transactions (audit rows), who (the database
    roles and the client's address and host) and the command line."""
    found = audit_commands(source, limit=limit)
    return rows_frame([(c.last.at, c.first.at, ", ".join(c.actions), ", ".join(c.targets) or None,
                        _json(c.counts), len(c.rows), c.last.login_role, c.last.db_role, c.last.client_addr,
                        c.last.client_host, c.last.command, c.last.command_id or c.last.request) for c in found], {
        "at": UTC_TS, "first_at": UTC_TS, "action": pl.String, "target": pl.String, "counts": pl.String,
        "transactions": pl.Int64, "login_role": pl.String, "db_role": pl.String, "client_addr": pl.String,
        "client_host": pl.String, "command": pl.String, "request": pl.String})


def unblock_command(month: str) -> str:
    """The command that lists (dry run) the active runs keeping ``month`` (YYYYMM) from
    retention; add ``--yes`` to cancel them."""
    start = month_start(month)
    end = datetime(start.year + start.month // 12, start.month % 12 + 1, 1, tzinfo=UTC)
    return shlex.join(["composer-ops", "runs", "cancel", "--since", start.strftime("%Y-%m-%d"),
                       "--until", end.strftime("%Y-%m-%d"), "--status", "RUNNING,PENDING"])


def archived_run_story(directory: str | Path, run_id: str, source: Source = None, *,
                       now: datetime | None = None) -> RunStory:
    """One run's story read from the Parquet archive of its month under ``directory``
    (what ``composer-ops partitions archive`` wrote), for a run whose month was dropped.
    Its definition comes from the database (``source``; definitions are never dropped),
    as does ``now``, the clock for intervals still open, unless given. The outbox and
    webhook tables are empty: they are not archived. :class:`NotFound` when the
    archive has no such run."""
    from composer_ops.core.manifest import MANIFEST, current_column, month_dir, read_manifest

    rid = validate_run_id(run_id)
    path = month_dir(Path(directory), month_of(rid))
    if not (path / MANIFEST).is_file():
        raise NotFound(f"workflow run {rid}: no archive of month {month_of(rid)} under {directory}")
    manifest = read_manifest(path)

    def rows(table: str, key: str) -> pl.DataFrame:
        entry = manifest.table(table)
        if entry is None:
            return pl.DataFrame()
        found = pl.scan_parquet(path / entry.file).filter(pl.col(key) == rid).collect()
        return found.rename({c: current_column(table, c) for c in found.columns})

    def err(column: str) -> pl.Expr:
        # The error document is {"error": text}; anything else is shown as its JSON.
        return pl.col(column).str.json_path_match("$.error").fill_null(pl.col(column))

    run_rows = rows("workflow_runs", "id")
    if run_rows.is_empty():
        raise NotFound(f"workflow run {rid} is not in the archive of month {manifest.month} ({path})")
    with connection(source) as conn:
        spec = analytics.definition_spec(conn, run_rows["workflow_definition_id"][0],
                                         int(run_rows["workflow_version"][0]))
        if now is None:
            now = analytics.db_now(conn).astimezone(UTC)
    clock = pl.lit(now, dtype=UTC_TS)
    run = run_rows.select(
        pl.col("id").alias("run_id"), pl.col("workflow_definition_id").alias("workflow_id"),
        pl.col("workflow_version").cast(pl.Int64), "status", "created_at", "updated_at", "completed_at",
        ((pl.coalesce("completed_at", clock) - pl.col("created_at")).dt.total_microseconds() / 1e6)
        .alias("duration_s"),
        pl.col("input_json").alias("input"), pl.col("output_json").alias("output"), err("error_json").alias("error"),
        pl.lit(f"archive {path}").alias("partition"))
    tasks = rows("task_instances", "run_id")

    def secs(a: pl.Expr, b: pl.Expr) -> pl.Expr:
        return (a - b).dt.total_microseconds() / 1e6

    tasks = tasks.sort("created_at", "node_id").select(
        pl.col("id").alias("task_id"), "node_id", "node_type", "queue", "state", pl.col("attempt").cast(pl.Int64),
        "created_at", "started_at", "finished_at", "updated_at",
        secs(pl.coalesce("started_at", "finished_at", clock), pl.col("created_at")).alias("queued_s"),
        secs(pl.coalesce("finished_at", clock), pl.col("started_at")).alias("ran_s"),
        "wake_at", secs(pl.col("wake_at"), clock).alias("wakes_in_s"), "signal_name", "lease_owner",
        "lease_expires_at", secs(pl.col("lease_expires_at"), clock).alias("lease_left_s"),
        err("last_error").alias("last_error"), "branches", pl.col("output_json").alias("output"),
    ).cast(dict(TASK_SCHEMA))  # type: ignore[arg-type]
    signal_rows = rows("workflow_events", "run_id")
    signals = signal_rows.sort("created_at", "id").select(
        pl.col("id").alias("signal_id"), "name", "payload", "created_at", "consumed_at",
        pl.when(pl.col("consumed_at").is_null()).then(pl.lit("buffered")).otherwise(pl.lit("consumed"))
        .alias("status"),
        secs(pl.coalesce("consumed_at", clock), pl.col("created_at")).alias("buffered_s"))
    nodes, edges = definition_graph(spec, tasks)
    empty_outbox = rows_frame([], {"task_id": pl.String, "queue": pl.String, "attempt": pl.Int64,
                                   "task_name": pl.String, "lease_s": pl.Int64, "available_at": UTC_TS,
                                   "available_in_s": pl.Float64})
    empty_webhook = rows_frame([], {"url": pl.String, "attempts": pl.Int64, "next_attempt_at": UTC_TS,
                                    "delivered_at": UTC_TS, "gave_up_at": UTC_TS, "last_status": pl.Int64,
                                    "last_error": pl.String, "created_at": UTC_TS})
    logged = rows("run_history", "run_id")
    history = rows_frame([], HISTORY_SCHEMA) if logged.is_empty() else logged.sort("seq").select(
        pl.col("seq").cast(pl.Int64), "at", "kind", "node_id", "task_id", pl.col("attempt").cast(pl.Int64),
        "worker", "request", "detail").cast(dict(HISTORY_SCHEMA))  # type: ignore[arg-type]
    deleted = run_rows["deleted_at"][0] if "deleted_at" in run_rows.columns else None
    return RunStory(run=run, nodes=nodes, edges=edges, tasks=tasks, signals=signals, outbox=empty_outbox,
                    webhook=empty_webhook, spec_found=spec is not None, history=history, deleted_at=deleted)


def definition_spec(source: Source, workflow_id: str, version: int) -> Any:
    """The spec_json of a definition version (None when that version is missing)."""
    with connection(source) as conn:
        return analytics.definition_spec(conn, workflow_id, version)
