"""The CI-size chaos run: 200 runs through real processes that are SIGKILLed while
PostgreSQL restarts once; nothing may be lost (see tests/chaos/driver.py)."""

from __future__ import annotations

import pytest

from composer_ops.testing.servers import Server
from tests.chaos.driver import assert_nothing_lost, ci_options, run_chaos


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_run_loses_nothing(server: Server, template_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_chaos(server, ci_options(start_rate=15.0, timeout_s=200.0), template=template_db)
    with capsys.disabled():
        print("\n" + "\n".join(report.lines()))
    assert_nothing_lost(report, restarts=1 if report.options.restart else 0)
    assert report.audit.figures["webhooks"]["refused_first"] > 0                # and the relay did retry
