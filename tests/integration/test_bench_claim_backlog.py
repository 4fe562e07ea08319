"""bench.claim_backlog (a one-task claim's cost behind a backlog) at a tiny size, so it
cannot rot: it measures every size, and the claim reads the rows it takes, not the
backlog behind them."""

from __future__ import annotations

import psycopg

from bench import claim_backlog
from composer_ops.testing.servers import Server


def test_claim_backlog_measures_each_size_and_reads_no_backlog(server: Server) -> None:
    out = claim_backlog.run(server, {"new": claim_backlog.ROOT}, sizes=[0, 300], claims=3, queues=2)
    got = out["results"]["new"]
    assert set(got) == {"0", "300"}
    for size in got.values():
        assert size["claim_ms"] > 0 and size["server_cpu_ms"] >= 0
        assert set(size["ratio_to_smallest"]) == {"claim_ms", "server_cpu_ms"}
    assert got["300"]["outbox_rows_read"] < 20          # 300 more before the pick followed the index
    assert out["templates"]["new"]["migrations"]
    with psycopg.connect(server.admin_url) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'bench_backlog%%'").fetchall()
    assert left == []
