"""Retention for the notebooks: the plan as a DataFrame, and the real drop.

Both come from the repository's one code path (:mod:`composer_ops.repo.retention`,
the SQL function ``composer_retention_plan``): :func:`retention_plan` shows its rows,
and :func:`drop_partitions` is :func:`composer_ops.engine.retention.drop_due_months`,
which locks each due month, judges it again under the lock, drops exactly what that
plan marks 'drop' and reports it. Cut-offs: see :func:`parse_cutoff`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import polars as pl

from composer_ops.core.runids import RUN_ID_MAX_AGE
from composer_ops.ops._common import UTC_TS, Source, connection, rows_frame
from composer_ops.repo import retention as repo
from composer_ops.repo.retention import Cutoff, parse_cutoff
from composer_ops.repo.rows import RetentionMonth

if TYPE_CHECKING:
    from composer_ops.engine.retention import RetentionResult

__all__ = ["PLAN_SCHEMA", "Cutoff", "DropResult", "drop_partitions", "parse_cutoff", "plan_frame", "retention_plan"]

PLAN_SCHEMA: dict[str, Any] = {
    "month": pl.String, "month_start": UTC_TS, "month_end": UTC_TS, "action": pl.String, "reason": pl.String,
    "active_runs": pl.Int64, "active_run_ids": pl.List(pl.String), "partitions": pl.List(pl.String),
    "rows": pl.Int64, "bytes": pl.Int64,
}


def retention_plan(source: Source = None, older_than: datetime | str | Cutoff = "6 months", *,
                   exact_rows: bool = False) -> pl.DataFrame:
    """For every partition month: drop or keep, why ('too new', 'has active runs' with
    the blocking run IDs, or 'past cut-off, no active runs'), and the rows and bytes
    its partitions hold (rows are catalog estimates unless ``exact_rows``).
    ``cutoff`` is the resolved instant, repeated on each row."""
    with connection(source) as conn:
        cutoff = repo.resolve(conn, older_than)
        months = repo.plan(conn, cutoff, min_age=RUN_ID_MAX_AGE, exact_rows=exact_rows)
    return _frame(months, cutoff)


def plan_frame(result: RetentionResult) -> pl.DataFrame:
    """The plan a drop judged (with its cut-off), as :func:`retention_plan` shows plans."""
    return _frame(result.plan, result.cutoff)


def _frame(months: list[RetentionMonth], cutoff: datetime) -> pl.DataFrame:
    rows = [tuple(getattr(m, column) for column in PLAN_SCHEMA) for m in months]
    return rows_frame(rows, PLAN_SCHEMA).with_columns(pl.lit(cutoff, dtype=UTC_TS).alias("cutoff"))


@dataclass(frozen=True, kw_only=True)
class DropResult:
    cutoff: datetime
    plan: pl.DataFrame
    dropped: list[str]
    attempts: int
    result: RetentionResult


def drop_partitions(source: Source = None, older_than: datetime | str | Cutoff = "6 months", *,
                    lock_timeout_s: float = 2.0, max_attempts: int = 5) -> DropResult:
    """Drop what the plan marks 'drop', for real, and commit (see the module)."""
    from composer_ops.engine.retention import drop_due_months  # a writer: the reports never load it

    done = drop_due_months(source, older_than, lock_timeout_s=lock_timeout_s, max_attempts=max_attempts)
    return DropResult(cutoff=done.cutoff, plan=plan_frame(done), dropped=done.dropped, attempts=done.attempts,
                      result=done)
