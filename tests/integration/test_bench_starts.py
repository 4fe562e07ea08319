"""bench.starts (starts side by side from several connections, per schema) at a tiny
size, so it cannot rot: every tree and round is measured, the figures are there and the
server keeps no database of it."""

from __future__ import annotations

import psycopg

from bench import starts
from composer_ops.testing.servers import Server


def test_starts_measures_each_tree_every_round_and_leaves_nothing(server: Server) -> None:
    # A count of starts, not a window: a loaded machine takes longer, never finds none.
    out = starts.run(server, {"a": starts.ROOT, "b": starts.ROOT}, threads=2, starts=10, rounds=2)
    assert set(out["per_round"]) == {"a", "b"} and all(len(r) == 2 for r in out["per_round"].values())
    local = server.owned                                # the server's CPU is read where it runs here only
    for got in (m for rounds in out["per_round"].values() for m in rounds):
        assert got["starts"] > 0 and got["starts_per_s"] > 0 and got["client_cpu_ms"] > 0 and got["multixacts"] >= 0
        assert (got["server_cpu_ms"] > 0) if local else got["server_cpu_ms"] is None
    assert out["ratio_to_a"]["a"] == {"starts_per_s": 1.0, "server_cpu_ms": 1.0 if local else None,
                                      "client_cpu_ms": 1.0}
    assert out["templates"]["a"]["migrations"]
    with psycopg.connect(server.admin_url) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'bench_starts%%'").fetchall()
    assert left == []
