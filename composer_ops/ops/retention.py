"""Retention for the notebooks: the plan as a DataFrame.

The plan comes from the repository's one code path (:mod:`composer_ops.repo.retention`,
the SQL function ``composer_retention_plan``): :func:`retention_plan` shows its rows,
and :func:`plan_frame` the plan a drop judged. The drop itself writes, so it is not
here: it is :func:`composer_ops.engine.retention.drop_due_months` (``composer-ops
partitions drop --yes``). Cut-offs: see :func:`parse_cutoff`.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

import polars as pl

from composer_ops.core.cutoff import Cutoff, parse_cutoff
from composer_ops.ops._common import UTC_TS, Source, connection, rows_frame
from composer_ops.repo import retention as repo
from composer_ops.repo.rows import RetentionMonth

if TYPE_CHECKING:
    from composer_ops.engine.retention import RetentionResult

__all__ = ["PLAN_SCHEMA", "Cutoff", "parse_cutoff", "plan_frame", "resolve_cutoff", "retention_plan"]

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
        plan = repo.plan(conn, older_than, exact_rows=exact_rows)
    return _frame(plan.months, plan.cutoff)


def resolve_cutoff(source: Source = None, older_than: datetime | str | Cutoff = "6 months") -> datetime:
    """The instant (UTC) a cut-off stands for, an age counted back from the database clock."""
    with connection(source) as conn:
        return repo.resolve(conn, older_than)


def plan_frame(result: RetentionResult) -> pl.DataFrame:
    """The plan a drop judged (with its cut-off), as :func:`retention_plan` shows plans."""
    return _frame(result.plan, result.cutoff)


def _frame(months: list[RetentionMonth], cutoff: datetime) -> pl.DataFrame:
    rows = [tuple(getattr(m, column) for column in PLAN_SCHEMA) for m in months]
    return rows_frame(rows, PLAN_SCHEMA).with_columns(pl.lit(cutoff, dtype=UTC_TS).alias("cutoff"))

