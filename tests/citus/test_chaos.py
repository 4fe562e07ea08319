"""The CI-size chaos run on Citus: 200 runs through real worker and coordinator processes
that are SIGKILLed, while one worker node's PostgreSQL is killed (``pg_ctl stop -m
immediate``: a crash) for a moment and started again; nothing may be lost or stuck
(tests/chaos/driver.py audits it)."""

from __future__ import annotations

import time

import pytest

from composer_ops.db.migrate import migrate
from composer_ops.testing.citus import CitusCluster
from tests.chaos.driver import assert_nothing_lost, ci_options, run_chaos_on

#: How long the worker node stays down.
DOWN_S = 1.5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_run_with_a_worker_node_killed_loses_nothing(citus_cluster: CitusCluster,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    node = citus_cluster.workers[0]

    def kill_a_worker_node() -> str:
        began = time.monotonic()
        with node.down("immediate"):
            time.sleep(DOWN_S)
        return f"worker node :{node.port} killed (pg_ctl stop -m immediate), down {time.monotonic() - began:.2f}s"

    # A database of its own: the audit adds a table and a trigger the other tests must not see.
    with citus_cluster.database(prefix="composer_chaos") as url:
        migrate(url)
        report = run_chaos_on(url, ci_options(start_rate=12.0, timeout_s=200.0), fault=kill_a_worker_node)
    with capsys.disabled():
        print("\n" + "\n".join(report.lines()))
    assert_nothing_lost(report, restarts=1)
