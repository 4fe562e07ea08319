"""Leases: which RUNNING tasks are about to expire, which already expired but are
still RUNNING (the lease sweeper is behind, or not running), which worker holds
what (a worker whose every lease is overdue is probably dead), how many attempts
active tasks are on, and the recent re-queues with the error that caused them.

The RUNNING queries filter on ``state = 'RUNNING'`` and the others on the active
states, the predicates of the partial indexes, so they read only live work. Time to
expiry is ``lease_expires_at - now()`` on the database clock, the clock the sweeper
itself judges by. A lease expiry of ``'infinity'`` or ``'-infinity'`` (odd data: the
engine never writes one) reads as ``datetime.max``/``min`` with a time to expiry of
plus or minus infinity, and is flagged by :func:`without_lease`.
"""

from __future__ import annotations

import polars as pl

from composer_ops.db.loaders import INFINITY, MINUS_INFINITY
from composer_ops.errors import Invalid
from composer_ops.ops._common import UTC_TS, Source, connection, rows_frame
from composer_ops.repo import analytics

#: Time-to-expiry buckets: (label, upper bound in seconds; None = unbounded).
EXPIRY_BUCKETS: tuple[tuple[str, float | None], ...] = (
    ("expired > 1 h ago", -3600), ("expired 5-60 min ago", -300), ("expired < 5 min ago", 0),
    ("expires in < 1 min", 60), ("expires in 1-5 min", 300), ("expires in 5-30 min", 1800),
    ("expires in > 30 min", None),
)

#: The bucket of a RUNNING task that holds no lease at all (odd data: see :func:`without_lease`).
NO_LEASE = "no lease"

_RUNNING_SCHEMA = {
    "run_id": pl.String, "task_id": pl.String, "node_id": pl.String, "queue": pl.String,
    "lease_owner": pl.String, "attempt": pl.Int64, "started_at": UTC_TS, "lease_expires_at": UTC_TS,
    "expires_in_s": pl.Float64, "running_s": pl.Float64,
}

def running_leases(source: Source = None) -> pl.DataFrame:
    """Every RUNNING task: owner, attempt, lease expiry, seconds until it expires
    (negative: expired), whether it is expired, and its expiry bucket."""
    with connection(source) as conn:
        df = rows_frame(analytics.running_leases(conn), _RUNNING_SCHEMA)
    bucket = pl.lit(EXPIRY_BUCKETS[-1][0])
    for label, upper in reversed(EXPIRY_BUCKETS[:-1]):
        assert upper is not None
        # An expiry exactly now counts as expired, as the sweeper (lease_expires_at <= now()) sees it.
        below = pl.col("expires_in_s") <= upper if upper <= 0 else pl.col("expires_in_s") < upper
        bucket = pl.when(below).then(pl.lit(label)).otherwise(bucket)
    return df.with_columns(
        # A RUNNING task without a lease is not expired (the sweeper never sees it): it is an anomaly.
        (pl.col("expires_in_s").is_not_null() & (pl.col("expires_in_s") <= 0)).alias("expired"),
        pl.when(pl.col("expires_in_s").is_null()).then(pl.lit(NO_LEASE)).otherwise(bucket).alias("bucket"),
    )


def expiry_buckets(leases: pl.DataFrame) -> pl.DataFrame:
    """RUNNING tasks per time-to-expiry bucket (from :func:`running_leases`), every
    bucket present, in time order."""
    labels = [label for label, _ in EXPIRY_BUCKETS] + [NO_LEASE]
    counted = leases.group_by("bucket").agg(pl.len().cast(pl.Int64).alias("tasks"))
    grid = pl.DataFrame({"bucket_order": list(range(len(labels))), "bucket": labels},
                        schema={"bucket_order": pl.Int64, "bucket": pl.String})
    return (grid.join(counted, on="bucket", how="left").with_columns(pl.col("tasks").fill_null(0))
            .sort("bucket_order"))


def without_lease(leases: pl.DataFrame) -> pl.DataFrame:
    """RUNNING tasks (from :func:`running_leases`, or a run's tasks) with no lease
    owner, no expiry, or an infinite expiry (:func:`infinite_expiry`): no worker can
    heartbeat them and the sweeper never expires them (or, at ``'-infinity'``, expires
    a lease no worker could have held), so they are odd data to flag."""
    return leases.filter(pl.col("lease_expires_at").is_null() | pl.col("lease_owner").is_null()
                         | infinite_expiry())


def odd_lease_counts(leases: pl.DataFrame) -> dict[str, int]:
    """How many RUNNING tasks (from :func:`running_leases`) have no lease (no owner or no
    expiry) and how many an infinite one (``'infinity'`` or ``'-infinity'``): the two
    kinds of :func:`without_lease`, each counted once (``without`` + ``infinite`` is its
    height)."""
    odd = without_lease(leases)
    infinite = odd.filter(infinite_expiry()).height
    return {"without": odd.height - infinite, "infinite": infinite}


def odd_lease_text(counts: dict[str, int]) -> str:
    """``1 without a lease, 1 with an infinite lease``: :func:`odd_lease_counts` in words
    (the infinite part only when there is one)."""
    text = f"{counts['without']:,} without a lease"
    return text + (f", {counts['infinite']:,} with an infinite lease" if counts["infinite"] else "")


def infinite_expiry(column: str = "lease_expires_at") -> pl.Expr:
    """True where ``column`` was read from ``'infinity'`` or ``'-infinity'``."""
    return pl.col(column).is_in([INFINITY, MINUS_INFINITY]).fill_null(False)


def expired_running(source: Source = None, *, leases: pl.DataFrame | None = None) -> pl.DataFrame:
    """RUNNING tasks whose lease has expired, most overdue first: the sweeper's lag.
    A few seconds is normal (the sweeper runs on an interval); minutes mean it is
    not running or cannot keep up."""
    df = leases if leases is not None else running_leases(source)
    return (df.filter(pl.col("expired"))
            .with_columns((-pl.col("expires_in_s")).alias("overdue_s"))
            .sort("overdue_s", "run_id", "task_id", descending=[True, False, False], nulls_last=True))


def lease_owners(source: Source = None, *, leases: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per lease owner (worker): RUNNING tasks, how many are expired, the most overdue,
    the next expiry; ``suspect_dead`` when every lease it holds is expired (a live
    worker heartbeats, so its leases stay in the future)."""
    df = leases if leases is not None else running_leases(source)
    return (df.with_columns(pl.col("lease_owner").fill_null("(none)"))
            .group_by("lease_owner")
            .agg(pl.len().cast(pl.Int64).alias("running"),
                 pl.col("expired").sum().cast(pl.Int64).alias("expired"),
                 (-pl.col("expires_in_s")).max().clip(lower_bound=0).alias("max_overdue_s"),
                 pl.col("lease_expires_at").min().alias("next_expiry"),
                 pl.col("started_at").min().alias("oldest_started_at"))
            .with_columns((pl.col("expired") == pl.col("running")).alias("suspect_dead"))
            .sort("lease_owner"))


def attempt_distribution(source: Source = None) -> pl.DataFrame:
    """Active tasks per attempt number (0 is the first try) and state."""
    with connection(source) as conn:
        return rows_frame(analytics.attempt_distribution(conn),
                          {"attempt": pl.Int64, "state": pl.String, "tasks": pl.Int64})


def recent_requeues(source: Source = None, *, window_s: float = 3600, limit: int = 50) -> pl.DataFrame:
    """Active tasks on a retry whose state changed within ``window_s`` seconds, newest
    first, with the last attempt's error. Tasks that since finished are not listed
    (that would mean scanning finished history); the run investigation notebook
    shows every attempt of one run."""
    if window_s <= 0 or limit < 1:
        raise Invalid(f"recent_requeues needs window_s > 0 and limit >= 1, got {window_s} and {limit}")
    with connection(source) as conn:
        return rows_frame(analytics.recent_requeues(conn, window_s, limit), {
            "run_id": pl.String, "task_id": pl.String, "node_id": pl.String, "node_type": pl.String,
            "queue": pl.String, "state": pl.String, "attempt": pl.Int64, "updated_at": UTC_TS,
            "since_s": pl.Float64, "last_error": pl.String,
        })
