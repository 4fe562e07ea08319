"""The CI-size chaos run on Citus: 200 runs through real worker and coordinator processes
that are SIGKILLed, while one worker node is lost and the Citus coordinator node crashes
(tests/chaos/driver.py audits that nothing is lost, duplicated or left unfinished).

The database-side fault, half-way through the starts: one worker node's PostgreSQL is
killed (``pg_ctl stop -m immediate``: a crash) and kept down for ``WORKER_DOWN_S``, long
enough that every event on its shards fails and is retried (by the engine, the workers'
claim loop, the coordinators' passes and the driver's client) for several seconds; it is
started again, and ``COORDINATOR_AFTER_S`` later, with events flowing again (two-phase
commits in flight included), the coordinator node's PostgreSQL is killed the same way and
started at once (crash recovery; every client connection is cut; transactions its
workers had prepared are left for Citus's recovery to finish or roll back).
"""

from __future__ import annotations

import time

import psycopg
import pytest

from composer_ops.db.migrate import migrate
from composer_ops.testing.citus import CitusCluster
from tests.chaos.driver import assert_nothing_lost, ci_options, run_chaos_on

#: How long the worker node stays down.
WORKER_DOWN_S = 6.0
#: How long after the worker node is back the coordinator node crashes.
COORDINATOR_AFTER_S = 1.5


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_chaos_run_with_a_worker_node_lost_and_the_coordinator_crashed_loses_nothing(
        citus_cluster: CitusCluster, capsys: pytest.CaptureFixture[str]) -> None:
    worker, coordinator = citus_cluster.workers[0], citus_cluster.coordinator
    outage: list[float] = []        # when the worker node went down and came back (epoch seconds)

    def lose_a_worker_node_then_crash_the_coordinator() -> str:
        began = time.monotonic()
        outage.append(time.time())
        with worker.down("immediate"):
            time.sleep(WORKER_DOWN_S)
        outage.append(time.time())
        worker_down = time.monotonic() - began
        left_by_worker = prepared()
        time.sleep(COORDINATOR_AFTER_S)
        crashed = time.monotonic()
        with coordinator.down("immediate"):
            pass
        down = time.monotonic() - crashed
        return (f"worker node :{worker.port} killed (pg_ctl stop -m immediate), down {worker_down:.2f}s, "
                f"{left_by_worker} transactions prepared on the workers when it was back; "
                f"{COORDINATOR_AFTER_S}s later the coordinator node :{coordinator.port} killed the same way "
                f"and started again, down {down:.2f}s, leaving {prepared()} transactions prepared on the workers")

    def prepared() -> int:
        """Transactions the worker nodes hold prepared (what Citus's recovery resolves)."""
        count = 0
        for node in citus_cluster.workers:
            with psycopg.connect(node.admin_url, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()
                count += int(row[0]) if row else 0
        return count

    # A database of its own: the audit adds a table and a trigger the other tests must not see.
    with citus_cluster.database(prefix="composer_chaos") as url:
        migrate(url)
        report = run_chaos_on(url, ci_options(start_rate=12.0, timeout_s=260.0),
                              fault=lose_a_worker_node_then_crash_the_coordinator)
        during: list[tuple[str, int]] = []
        if len(outage) == 2:
            with psycopg.connect(url) as conn:
                # Task transitions committed while the worker node was down, on the nodes still up.
                during = [(str(r[0]), int(r[1])) for r in conn.execute(
                    """SELECT new_state, count(*) FROM chaos_transitions WHERE at BETWEEN %s AND %s
                        GROUP BY 1 ORDER BY 1""", (outage[0], outage[1]))]
    with capsys.disabled():
        print("\n" + "\n".join(report.lines()))
        print(f"  task transitions committed while the worker node was down: {dict(during) or 'none'}")
    assert_nothing_lost(report, restarts=1)
