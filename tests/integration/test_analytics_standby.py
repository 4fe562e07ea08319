"""Reports on a read replica, for real: a streaming hot standby of a PostgreSQL 15
primary (pg_basebackup, a second local server) answers `composer-ops report --all` and
`composer-ops check` while the primary takes traffic from a worker, a coordinator and a
stream of starts; every report says in its header that it read a standby, and how far
behind it was.

It runs in the PostgreSQL 15 leg (COMPOSER_TEST_PGBIN): the pair is made of those
binaries, whatever server the rest of the session uses."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.db.migrate import migrate
from composer_ops.testing import replica
from composer_ops.testing.processes import Fleet
from composer_ops.testing.servers import ServerGroup

PGBIN = os.environ.get("COMPOSER_TEST_PGBIN")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(not PGBIN, reason="the PostgreSQL 15 leg (COMPOSER_TEST_PGBIN) makes the standby")]

SPEC = {"id": "traffic", "nodes": [{"id": "a", "type": "TASK", "task": "work"},
                                   {"id": "b", "type": "TASK", "task": "work", "depends_on": ["a"]}]}


@pytest.fixture(scope="module")
def pair() -> Iterator[ServerGroup]:
    assert PGBIN is not None
    group = replica.start_pair(PGBIN)
    yield group
    group.stop()


def test_report_all_runs_on_a_hot_standby_while_the_primary_takes_traffic(
        pair: ServerGroup, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    primary, standby = pair.primary, pair[replica.STANDBY]
    url = primary.create_database("composer_standby")
    migrate(url)
    with Engine.connect(url, pool_size=4) as engine:
        engine.deploy(SPEC)
        before = [engine.start("traffic", input={"n": i}) for i in range(20)]
        replica.wait_replayed(primary, standby)
        started: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                started.append(engine.start("traffic"))
                time.sleep(0.05)

        standby_url = standby.url("composer_standby")
        with Fleet(url) as fleet:
            fleet.worker(concurrency=4)
            fleet.coordinator()
            starter = threading.Thread(target=traffic)
            starter.start()
            try:
                code = main(["report", "--all", "--database-url", standby_url, "--out", str(tmp_path / "reports"),
                             "--progress", "0", "-p", "cutoff", "1 month", "-p", "run_id", before[0]])
                printed = capsys.readouterr()
                checked = main(["check", "--json", "--database-url", standby_url])
                health = json.loads(capsys.readouterr().out)
            finally:
                stop.set()
                starter.join()
        assert code == 0, printed.err
        assert checked in (0, 1)
        replay = next(c for c in health["checks"] if c["metric"] == "composer_replay_lag_seconds")
        assert replay["detail"].startswith("a hot standby,") and "WAL receiver streaming" in replay["detail"]
        assert not replay["alert"] and 0 <= replay["value"] < 60
        replica.wait_replayed(primary, standby)
    assert len(started) > 20                   # the primary took writes while the reports ran
    with psycopg.connect(standby_url) as conn:
        row = conn.execute("SELECT pg_is_in_recovery(), count(*) FROM workflow_runs").fetchone()
    assert row == (True, len(before) + len(started))
    for name in ("active_tasks", "lease_expiries", "partition_sizes", "retention_dry_run", "run_investigation"):
        page = next((tmp_path / "reports" / name).glob("*.html"))
        assert json.loads(page.with_suffix(".json").read_text())["ok"] is True, name
        header = re.search(r"Read from a hot standby: replay lag ([^<]+)</b> \(last replayed transaction "
                           r"committed (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC; WAL receiver streaming\)",
                           page.read_text(encoding="utf-8"))
        assert header, f"{name}: no replay-lag header"
