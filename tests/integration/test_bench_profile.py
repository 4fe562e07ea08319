"""bench.profile (CPU per run by process and by statement) at a tiny size, so it cannot
rot: with two worker processes (``--workers``) both count, runs complete inside the
window, the sessions' states are sampled (``--waits``), and it leaves no database behind."""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
import pytest

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
    assert waits["samples"] > 0 and waits["runs"] > 0 and waits["interval_s"] >= profile.WAIT_SAMPLE_S
    workers = waits["sessions_by_state"]["composer-worker"]
    assert sum(workers.values()) >= 2                          # sessions, not shares: two processes' at least
    assert sum(v for k, v in workers.items() if k != "idle") > 0   # seen at work, not only between transactions
    assert all(k in ("idle", "idle in transaction") or k.startswith("active: ") for k in workers)

    with psycopg.connect(server.admin_url) as conn:
        listen = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'composer-listen'")
        assert listen.fetchone() == (0,)
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'bench_profile%%'").fetchall()
    assert left == []


def test_py_spy_samples_of_a_roles_processes_add_up() -> None:
    spied: dict[str, Any] = {}
    profile._add_samples(spied, "worker", (3, Counter({"a": 3, "b": 1}), Counter({"b": 1})))
    profile._add_samples(spied, "worker", (2, Counter({"a": 2}), Counter({"a": 2})))
    profile._add_samples(spied, "producer", (1, Counter({"p": 1}), Counter({"p": 1})))
    assert spied == {"worker": (5, Counter({"a": 5, "b": 1}), Counter({"a": 2, "b": 1})),
                     "producer": (1, Counter({"p": 1}), Counter({"p": 1}))}


@pytest.mark.parametrize("argv", [["--workers", "0"], ["--seconds", "0"]])
def test_bad_counts_are_refused_before_any_server_starts(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        profile.main(["--pgbin", "", *argv])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--workers must be at least 1 and --seconds above 0" in err and len(err.strip().splitlines()[-1]) < 200
