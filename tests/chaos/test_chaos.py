"""The CI-size chaos run: 200 runs through real processes that are SIGKILLed while
PostgreSQL restarts once; nothing may be lost (see tests/chaos/driver.py)."""

from __future__ import annotations

import os

import pytest

from composer_ops.testing.servers import Server
from tests.chaos.driver import Options, run_chaos

RUNS = int(os.environ.get("COMPOSER_CHAOS_RUNS", "200"))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_chaos_run_loses_nothing(server: Server, template_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_chaos(server, Options(runs=RUNS, seed=int(os.environ.get("COMPOSER_CHAOS_SEED", "7")),
                                          start_rate=15.0, timeout_s=85.0), template=template_db)
    with capsys.disabled():
        print("\n" + "\n".join(report.lines()))
    assert report.ok, "\n".join(report.lines())
    figures = report.audit.figures
    assert figures["runs"] == RUNS and sum(report.kills.values()) >= 5
    assert len(report.restarts) == (1 if report.options.restart else 0)
    assert figures["requeues"].get("lease expired: worker killed", 0) > 0      # the kills did hit running tasks
    assert figures["webhooks"]["refused_first"] > 0                             # and the relay did retry
