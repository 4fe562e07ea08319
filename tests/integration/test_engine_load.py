"""Load held: 1,000 starts from 8 concurrent clients through a pool of 4 connections.

Every start succeeds or fails with :class:`Unavailable` (retryable); nothing
deadlocks (the timeout marker); the rate is printed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

from composer_ops import Engine, Unavailable
from composer_ops.db import make_pool

CLIENTS = 8
RUNS = 1000
SPEC = {"id": "load", "nodes": [
    {"id": "a", "type": "TASK", "task": "t"},
    {"id": "b", "type": "TASK", "task": "t"},
    {"id": "c", "type": "TASK", "task": "t", "depends_on": ["a", "b"]}]}


def _counts(db_url: str) -> tuple[int, int, int]:
    with psycopg.connect(db_url) as conn:
        row: Any = conn.execute("""SELECT (SELECT count(*) FROM workflow_runs), (SELECT count(*) FROM task_instances),
                                          (SELECT count(*) FROM task_outbox)""").fetchone()
        return int(row[0]), int(row[1]), int(row[2])


@pytest.mark.timeout(300)          # 1,000 transactions: minutes on a loaded 2-core machine
def test_1000_starts_from_8_clients_through_a_pool_of_4(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    engine = Engine(make_pool(db_url, min_size=1, max_size=4, application_name="load", timeout=5.0), db_url)
    engine.deploy(SPEC)
    ids: list[str] = []
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    gate = threading.Barrier(CLIENTS)

    def client(n: int) -> None:
        gate.wait()
        for i in range(RUNS // CLIENTS):
            try:
                run_id = engine.start("load", input={"client": n, "i": i})
            except Unavailable as exc:           # the only acceptable failure: retry later
                with lock:
                    outcomes[f"unavailable: {exc}"] += 1
                continue
            except Exception as exc:  # noqa: BLE001 - anything else is a finding, counted and shown
                with lock:
                    outcomes[f"{type(exc).__module__}.{type(exc).__name__}: {exc}"] += 1
                continue
            with lock:
                ids.append(run_id)
                outcomes["ok"] += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    engine.close()
    with capsys.disabled():
        print(f"\nload: {outcomes['ok']} of {RUNS} starts from {CLIENTS} clients through a pool of 4 in "
              f"{elapsed:.2f}s = {outcomes['ok'] / elapsed:.0f} starts/s; other outcomes "
              f"{ {k: v for k, v in outcomes.items() if k != 'ok'} or 'none'}")
    assert set(outcomes) <= {"ok"} | {k for k in outcomes if k.startswith("unavailable: ")}, outcomes
    assert len(set(ids)) == len(ids) == outcomes["ok"]
    assert _counts(db_url) == (len(ids), 2 * len(ids), 2 * len(ids))   # roots a and b, each dispatched once


def test_a_starved_pool_fails_starts_with_unavailable_and_writes_nothing(db_url: str) -> None:
    engine = Engine(make_pool(db_url, min_size=1, max_size=1, application_name="starved"), db_url)
    engine.pool.timeout = 0.05          # once open: opening on a loaded machine may take longer
    try:
        engine.deploy(SPEC)
        errors: list[BaseException] = []
        with engine.pool.connection():           # the only connection is busy for the whole attempt
            def client() -> None:
                try:
                    engine.start("load")
                except BaseException as exc:  # noqa: BLE001 - recorded for the assertions below
                    errors.append(exc)

            threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert len(errors) == CLIENTS
        assert all(isinstance(e, Unavailable) for e in errors), [type(e) for e in errors]
        assert "retr" in str(errors[0]) and "\n" not in str(errors[0])
        assert engine.start("load")                  # and it works again once a connection is free
    finally:
        engine.close()
    assert _counts(db_url)[0] == 1
