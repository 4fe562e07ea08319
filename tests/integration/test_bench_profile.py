"""bench.profile (CPU per run by process and by statement) at a tiny size, so it cannot
rot: with two worker processes (``--workers``) both count, runs complete inside the
window, the sessions' states are sampled (``--waits``), and it leaves no database behind."""

from __future__ import annotations

import psycopg

from bench import profile
from bench.workload import COMPOSER, make_template
from composer_ops.testing.servers import Server


def test_profile_counts_every_worker_process_and_cleans_up(server: Server) -> None:
    template = make_template(server, "bench_tpl_profile_test")
    try:
        out = profile.profile(COMPOSER, server, template, seconds=2.0, spy=None, statements=False, workers=2,
                              waits=True)
    finally:
        server.drop_database(template)
    assert out["workers"] == 2 and out["processes"] == {"worker": 2, "coordinator": 1, "producer": 1}
    assert out["runs"] > 0
    assert out["cpu_ms_per_run"]["worker"] > 0 and out["cpu_ms_per_run_total"] > 0
    assert "statements" not in out and "py_spy" not in out
    waits = out["waits"]
    assert waits["samples"] > 0
    assert sum(waits["sessions_by_state"]["composer-worker"].values()) >= 1   # sessions, not shares
    with psycopg.connect(server.admin_url) as conn:
        listen = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'composer-listen'")
        assert listen.fetchone() == (0,)
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'bench_profile%%'").fetchall()
    assert left == []
