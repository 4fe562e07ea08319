"""A queue's max_running under racing worker processes (the claim of sql/R__claim.sql,
its flow_slots and the trigger that frees them): four workers of concurrency 3 claim
from a queue limited to 3 while two of them are SIGKILLed mid-task. Sampled from the
database in one snapshot each time, the queue's RUNNING tasks never pass the limit and
always equal the places taken; every run still finishes."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.testing.processes import Fleet, wait_for

LIMIT = 3
RUNS = 40

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_limit_is_never_exceeded_while_workers_are_killed(db_url: str, engine: Engine) -> None:
    engine.deploy({"id": "limited", "nodes": [{"id": "t", "type": "TASK", "task": "slow", "queue": "slow",
                                               "lease_s": 2, "max_lease_expiries": 50,
                                               "input": {"sleep": 0.3}}]})
    engine.queues.set_limit("slow", LIMIT)
    runs = [engine.start("limited") for _ in range(RUNS)]
    samples: list[tuple[int, int]] = []
    done = threading.Event()

    def sample() -> None:
        with psycopg.connect(db_url, autocommit=True) as conn:
            while not done.is_set():
                row = conn.execute("""
                    SELECT (SELECT count(*) FROM task_instances WHERE state = 'RUNNING' AND queue = 'slow'),
                           (SELECT count(*) FROM flow_slots WHERE key = 'queue:slow')""").fetchone()
                assert row is not None
                samples.append((int(row[0]), int(row[1])))
                time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with Fleet(db_url) as fleet:
            workers = [fleet.worker(concurrency=3) for _ in range(4)]
            fleet.coordinator()

            def finished() -> int:
                return sum(engine.get_run(r).status == "SUCCEEDED" for r in runs)

            for victim in workers[:2]:                 # killed while holding tasks
                wait_for(lambda: any(s[0] > 0 for s in samples[-5:]), timeout=60, what="tasks running")
                fleet.kill(victim, replace=True)
            wait_for(lambda: finished() == RUNS, timeout=240, interval=0.5, what="every run to succeed")
    finally:
        done.set()
        sampler.join(10)
    assert samples, "the sampler read nothing"
    over = [s for s in samples if s[0] > LIMIT]
    assert not over, f"{len(over)} samples over the limit, e.g. {over[:3]}"
    assert all(running == slots for running, slots in samples), [s for s in samples if s[0] != s[1]][:3]
    assert max(running for running, _ in samples) == LIMIT     # the limit was reached: it did the limiting
