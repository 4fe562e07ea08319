"""The operator commands as an on-call engineer runs them: Ctrl-C in ``runs cancel
--yes`` says how far it got, with no driver noise; ``runs list`` and ``workers list``
never cut the IDs and inputs a search was on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.core.selection import selection
from composer_ops.engine import admin
from composer_ops.testing.processes import wait_for

ROOT = Path(__file__).resolve().parents[2]
LONG_WORKFLOW = "order-fulfilment-eu-west-priority-lane"


def _count(db_url: str, query: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(query.encode()).fetchone()
        return int(row[0]) if row else 0


def test_ctrl_c_in_a_bulk_cancel_says_how_many_of_how_many_and_a_rerun_finishes(db_url: str) -> None:
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy({"id": "bulk", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        for i in range(1000):
            engine.start("bulk", input={"k": "bulk", "i": i})
        totals: list[int] = []
        admin.cancel_runs(engine.shell, selection(where="input.k=bulk"), reason="r", yes=False,
                          on_total=totals.append)
        assert totals == []                    # a dry run counts nothing more than it lists
    env = {**os.environ, "COMPOSER_DATABASE_URL": db_url, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "composer_ops", "runs", "cancel", "--where", "input.k=bulk",
                             "--yes", "--chunk", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # Mid-cancel: a few chunks committed (each writes its audit row), most runs still active.
        wait_for(lambda: _count(db_url, "SELECT count(*) FROM operator_audit WHERE action = 'runs cancel'") >= 3
                 or proc.poll() is not None, timeout=120, what="the first chunks of the cancel")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (out, err)
    lines = err.strip().splitlines()
    found = re.fullmatch(r"composer-ops: interrupted: (\d+) done of (\d+); run it again to finish", lines[-1])
    assert found, err
    done = _count(db_url, "SELECT count(*) FROM workflow_runs WHERE status = 'CANCELLED'")
    assert (int(found[1]), int(found[2])) == (done, 1000) and 0 < done < 1000
    assert not re.search(r"psycopg|Traceback|warning", err, re.IGNORECASE), err
    # Run again: the rest, each run once.
    assert main(["runs", "cancel", "--where", "input.k=bulk", "--yes", "--database-url", db_url]) == 0
    assert _count(db_url, "SELECT count(*) FROM workflow_runs WHERE status = 'CANCELLED'") == 1000


def test_a_bulk_cancel_is_told_its_total_before_the_first_chunk(db_url: str) -> None:
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy({"id": "bulk", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        for i in range(7):
            engine.start("bulk", input={"k": "bulk" if i < 5 else "other"})
        seen: list[tuple[str, int]] = []
        admin.cancel_runs(engine.shell, selection(where="input.k=bulk"), reason="r", yes=True, chunk=2,
                          on_total=lambda n: seen.append(("total", n)),
                          on_chunk=lambda c: seen.append(("chunk", len(c.cancelled))))
    assert seen == [("total", 5), ("chunk", 2), ("chunk", 2), ("chunk", 1)]


def test_runs_list_shows_the_whole_workflow_id_and_the_input_searched(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    customer = "customer-with-a-long-account-reference-0042-eu"
    with Engine.connect(db_url) as engine:
        engine.deploy({"id": LONG_WORKFLOW, "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
        run = engine.start(LONG_WORKFLOW, input={"customer": customer, "note": "x" * 60})
    assert main(["runs", "list", "--where", f"input.customer={customer}", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(run))
    assert f"{LONG_WORKFLOW} v1" in row and customer in row and "x" * 60 in row and "..." not in row


def test_workers_list_shows_whole_worker_ids_and_queues(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    worker = "worker-on-a-host-with-a-long-name.eu-west-1.internal-12345-abcdef"
    queues = ["payments-priority", "shipping-express", "notifications"]
    with psycopg.connect(db_url) as conn:
        conn.execute("INSERT INTO workers (id, host, pid, queues, concurrency, heartbeat_s) "
                     "VALUES (%s, 'h', 1, %s, 4, 5)", (worker, queues))
    assert main(["workers", "list", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if worker in line)
    assert ",".join(queues) in row
