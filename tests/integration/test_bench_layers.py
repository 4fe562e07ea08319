"""bench.layers (each event's server CPU in the engine's functions and as plain
statements writing the same rows) at a tiny size, so it cannot rot: both sides write
every event's rows (measure checks the runs and the outbox afterwards) and it leaves
no database behind."""

from __future__ import annotations

import psycopg

from bench import layers
from bench.workload import make_template
from composer_ops.testing.servers import Server


def test_layers_measures_both_sides_of_every_event_and_cleans_up(server: Server) -> None:
    template = make_template(server, "bench_tpl_layers_test")
    try:
        out = layers.measure(server, template, runs=3, rounds=2)
    finally:
        server.drop_database(template)
    for side in ("engine", "plain"):
        assert set(out["median"][side]) == set(layers.EVENTS)
        assert all(len(v) == 2 for v in out["server_ms_per_event"][side].values())
        assert out["per_run"][side] > 0
    assert set(out["plain_over_engine"]) == set(layers.EVENTS)
    assert len(out["plain_complete_and_claim_together"]) == 2 and out["together_over_apart"] > 0
    with psycopg.connect(server.admin_url) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'bench_layers%%'").fetchall()
    assert left == []
