"""A claim behind a backlog reads about as many outbox rows as it takes, not the backlog.

The claim's count of ready rows no wake-up covers (composer_uncovered, sql/R__claim.sql)
has a LIMIT, which an index scan stops at; the bitmap scan its generic plan chose read
every ready row's index entry first, twice in a claim that took all it asked for.
"""

from __future__ import annotations

from typing import Any

import psycopg

from composer_ops.repo import outbox

BACKLOG = 2000
CLAIMS = 5

_READ = """
    SELECT COALESCE(sum(idx_tup_read), 0) + (SELECT COALESCE(seq_tup_read, 0) FROM pg_stat_user_tables
                                               WHERE relid = 'task_outbox'::regclass)
      FROM pg_stat_user_indexes WHERE relid = 'task_outbox'::regclass"""


def _outbox_rows_read(conn: Any) -> int:
    """Outbox rows and index entries this database has read, this backend's included:
    its pending counts are flushed when its transaction before this one ends."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(_READ).fetchone()
    assert row is not None
    return int(row[0])


def _claim(conn: Any, claim_id: str) -> None:
    """A listening worker's claim of one task with room for four, rolled back: it counts
    the ready rows no wake-up covers before its pick. (No task rows: the rows it picks
    claim nothing.)"""
    with conn.transaction():
        outbox.claim(conn, ["default"], "w", 1, task_names=["t"], claim_id=claim_id,
                     wake=outbox.wake_channel("w"), room=4, seen=0)
        raise psycopg.Rollback()


def test_a_claim_behind_a_backlog_reads_rows_in_proportion_to_what_it_takes(db_url: str) -> None:
    """The session's plans are made while the outbox is empty, as a worker's are when it
    starts before a backlog builds up; then 2,000 rows are ready."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        _claim(conn, "warm")
        conn.execute("""
            INSERT INTO task_outbox (queue, run_id, task_id, attempt, task_name, lease_s, available_at)
            SELECT 'default', 'run-' || i, 'a', 0, 't', 30, now() - interval '1 minute'
              FROM generate_series(1, %s) AS i""", (BACKLOG,))
        before = _outbox_rows_read(conn)
        for k in range(CLAIMS):
            _claim(conn, f"c{k}")
        per_claim = (_outbox_rows_read(conn) - before) / CLAIMS
    assert 0 < per_claim < BACKLOG / 20, per_claim
