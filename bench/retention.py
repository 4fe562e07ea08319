"""Retention at scale: drop a month's partitions versus DELETE the same rows.

Two past months (14 and 13 months ago) are filled with the same shape of finished
history: ``rows`` task rows, 10 per run (so rows / 10 runs), COMPLETED, with small
JSON inputs and outputs, through all of task_instances' indexes. Then:

- month A goes with ``composer_drop_partitions(cut-off)`` (what ``composer-ops
  partitions drop --yes`` runs): its three partitions are dropped;
- month B goes with DELETE, children first, in one transaction (the foreign keys'
  ON DELETE CASCADE triggers still fire per run), followed by the VACUUM that DELETE
  makes necessary before the space can be reused.

Reports the time, the WAL written, and the bytes on disk before and after each.
``python -m bench.retention --rows N`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from typing import Any

import psycopg

from composer_ops.testing.servers import Server

FILL = """
WITH runs AS (
    SELECT g, lpad(to_hex(%(ms0)s::bigint + g * %(step)s::bigint), 12, '0') AS h, md5(g::text) AS m
      FROM generate_series(1, %(runs)s) g),
ins AS (
    INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, input_json, context_json,
                               output_json, created_at, completed_at)
    SELECT substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(m, 1, 3) || '-8' || substr(m, 4, 3)
           || '-' || substr(m, 7, 12), 'bench-fan', 1, 'SUCCEEDED', '{"n": 1}', '{"input": {"n": 1}, "config": {}}',
           '{"join": null}', %(t0)s::timestamptz, %(t0)s::timestamptz
      FROM runs
    RETURNING id)
INSERT INTO task_instances (id, run_id, node_id, node_type, queue, state, input_json, output_json,
                            started_at, finished_at, completed_at, created_at)
SELECT ins.id || '-' || n, ins.id, 'n' || n, 'TASK', 'default', 'COMPLETED', '{"n": 1}', '{"ok": true}',
       %(t0)s::timestamptz, %(t0)s::timestamptz, %(t0)s::timestamptz, %(t0)s::timestamptz
  FROM ins, generate_series(0, 9) n
"""


def _month(today: date, back: int) -> date:
    index = today.year * 12 + today.month - 1 - back
    return date(index // 12, index % 12 + 1, 1)


def _fill(conn: psycopg.Connection[Any], month: date, rows: int) -> float:
    runs = max(1, rows // 10)
    ms0 = int(time.mktime(month.timetuple()) * 1000) + 3 * 86400 * 1000   # safely inside the month
    step = max(1, (20 * 86400 * 1000) // runs)
    start = time.monotonic()
    conn.execute(FILL, {"ms0": ms0, "step": step, "runs": runs, "t0": month.isoformat()})
    return time.monotonic() - start


def _bytes(conn: psycopg.Connection[Any], suffix: str) -> int:
    row = conn.execute("""SELECT COALESCE(sum(pg_total_relation_size(to_regclass(t || '_p' || %s))), 0)::bigint
                            FROM unnest(ARRAY['workflow_runs', 'task_instances', 'workflow_events']) t""",
                       (suffix,)).fetchone()
    return int(row[0]) if row else 0


def _timed(conn: psycopg.Connection[Any], statements: list[tuple[str, Any]], *, transaction: bool = True
           ) -> tuple[float, int]:
    """Seconds and WAL bytes of the statements (one transaction unless told otherwise)."""
    lsn0 = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]  # type: ignore[index]
    start = time.monotonic()
    if transaction:
        with conn.transaction():
            for sql, params in statements:
                conn.execute(sql, params)
    else:
        for sql, params in statements:
            conn.execute(sql, params)
    elapsed = time.monotonic() - start
    wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (lsn0,)).fetchone()[0]  # type: ignore[index]
    return elapsed, int(wal)


def measure(server: Server, template: str, *, rows: int = 1_000_000) -> dict[str, Any]:
    db = "bench_retention"
    url = server.create_database(db, template=template)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            today: date = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()[0]  # type: ignore[index]
            month_a, month_b = _month(today, 14), _month(today, 13)
            conn.execute("SELECT composer_ensure_partitions_from(%s, 1)", (month_a,))
            fill_s = _fill(conn, month_a, rows) + _fill(conn, month_b, rows)
            a, b = month_a.strftime("%Y%m"), month_b.strftime("%Y%m")
            counted = conn.execute(f"SELECT (SELECT count(*) FROM task_instances_p{a}), "
                                   f"(SELECT count(*) FROM task_instances_p{b})").fetchone()
            size_a, size_b = _bytes(conn, a), _bytes(conn, b)
            lo, hi = conn.execute("SELECT composer_uuid7_bound(%s::timestamptz), composer_uuid7_bound(%s::timestamptz)",
                                  (month_b.isoformat(), _month(today, 12).isoformat())).fetchone()  # type: ignore[misc]

            server.checkpoint()
            drop_s, drop_wal = _timed(conn, [("SELECT composer_drop_partitions(%s::timestamptz)",
                                              (month_b.isoformat(),))])
            dropped = conn.execute("SELECT to_regclass(%s) IS NULL", (f"task_instances_p{a}",)).fetchone()[0]  # type: ignore[index]

            server.checkpoint()
            delete_s, delete_wal = _timed(conn, [
                ("DELETE FROM workflow_events WHERE run_id >= %s AND run_id < %s", (lo, hi)),
                ("DELETE FROM task_instances WHERE run_id >= %s AND run_id < %s", (lo, hi)),
                ("DELETE FROM workflow_runs WHERE id >= %s AND id < %s", (lo, hi)),
            ])
            size_b_deleted = _bytes(conn, b)
            vacuum_s, vacuum_wal = _timed(conn, [(f"VACUUM task_instances_p{b}", None),
                                                 (f"VACUUM workflow_runs_p{b}", None),
                                                 (f"VACUUM workflow_events_p{b}", None)], transaction=False)
            size_b_vacuumed = _bytes(conn, b)
        return {
            "task_rows_per_month": rows, "runs_per_month": rows // 10, "fill_s": fill_s,
            "task_rows_counted": list(counted) if counted else None,
            "drop": {"month": a, "dropped": bool(dropped), "seconds": drop_s, "wal_bytes": drop_wal,
                     "bytes_before": size_a, "bytes_after": 0},
            "delete": {"month": b, "seconds": delete_s, "wal_bytes": delete_wal, "bytes_before": size_b,
                       "bytes_after_delete": size_b_deleted, "vacuum_seconds": vacuum_s,
                       "vacuum_wal_bytes": vacuum_wal, "bytes_after_vacuum": size_b_vacuumed},
            "delete_over_drop": delete_s / drop_s if drop_s > 0 else None,
            "delete_and_vacuum_over_drop": (delete_s + vacuum_s) / drop_s if drop_s > 0 else None,
        }
    finally:
        server.drop_database(db)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.retention")
    parser.add_argument("--rows", type=int, default=1_000_000, help="task rows per month (default 1,000,000)")
    args = parser.parse_args()
    from bench.workload import make_template
    from composer_ops.testing import servers

    server = servers.session().primary
    template = make_template(server, "bench_tpl_retention")
    print(json.dumps(measure(server, template, rows=args.rows), indent=2))


if __name__ == "__main__":
    main()
