"""bench.flowcost (flow control's cost in the claim, in `make bench`) at a tiny size, so it
cannot rot: every configuration is what it says, and the summary holds every round."""

from __future__ import annotations

import io
from typing import Any

import psycopg
import pytest
from rich.console import Console

from bench import flowcost
from composer_ops.testing.servers import Server

RUNS, ROUNDS, OTHERS = 3, 2, 2


def test_flowcost_measures_each_configuration_side_by_side(server: Server) -> None:
    logged: list[str] = []
    out = flowcost.measure(server, runs=RUNS, rounds=ROUNDS, other_queues=OTHERS, held=2, warmup=2,
                           log=logged.append)

    assert len(logged) == ROUNDS * len(flowcost.MODES) * len(flowcost.CONFIGS)
    names = list(flowcost.CONFIGS)
    assert [r["order"] for r in out["rounds_detail"]] == [names, (names[1:] + names[:1])[::-1]]
    for rd in out["rounds_detail"]:
        for mode in flowcost.MODES:
            for config, got in rd["by_config"][mode].items():
                ready = RUNS if mode == "backlog" else 1
                assert got["facts_before"] == {
                    "ckey_dispatches": ready if config == "c_concurrency" else 0,
                    "rkey_dispatches": ready if config == "d_rate_limit" else 0,
                    "queue_slots": 0, "key_slots": 0,
                    "settings_rows": {"b_max_running": 1, "e_others": OTHERS + 1}.get(config, 0),
                    "paused_queues": 1 if config == "e_others" else 0}, (mode, config)
                assert got["facts_after"]["queue_slots"] == (RUNS if config == "b_max_running" else 0)
                assert got["facts_after"]["key_slots"] == (RUNS if config == "c_concurrency" else 0)
                cpu = got["server_cpu_ms_per_claim"]
                assert cpu is not None and (cpu > 0 or out["cpu_source"] != "schedstat")
                assert got["claim_p50_ms"] > 0

    for mode in flowcost.MODES:
        assert set(out["ratios"][mode]) == {"b/a", "c/a", "d/a", "e/a"}
        for ratio in out["ratios"][mode].values():
            cpu_ratio: dict[str, Any] = ratio["server_cpu_ms_per_claim"]
            if out["cpu_source"] == "schedstat":
                assert len(cpu_ratio["rounds"]) == ROUNDS
                assert cpu_ratio["min"] <= cpu_ratio["median"] <= cpu_ratio["max"]
            assert len(ratio["claim_p50_ms"]["rounds"]) == ROUNDS
    assert set(flowcost.headline(out)) == {f"{m} {k}" for m in flowcost.MODES for k in ("b/a", "c/a", "d/a", "e/a")}

    text = io.StringIO()
    Console(file=text, width=250).print(flowcost.table(out))
    assert all(config in text.getvalue() for config in flowcost.CONFIGS)
    with psycopg.connect(server.admin_url) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'bench_flow%%'").fetchall()
    assert left == []


def test_a_configuration_not_applied_is_refused() -> None:
    applied = {"ckey_dispatches": 0, "rkey_dispatches": 0, "queue_slots": 0, "key_slots": 0, "settings_rows": 1,
               "paused_queues": 0}
    flowcost.verify("b_max_running", applied, {**applied, "queue_slots": 5}, 5, 5, OTHERS)
    with pytest.raises(RuntimeError, match=r"b_max_running .*queue_slots 0 \(expected 5\) after 5 claims"):
        flowcost.verify("b_max_running", applied, applied, 5, 5, OTHERS)
    with pytest.raises(RuntimeError, match=r"d_rate_limit .*rkey_dispatches 0 \(expected 5\) with 5 queued"):
        flowcost.verify("d_rate_limit", {**applied, "settings_rows": 0}, applied, 5, 5, OTHERS)
