"""bench.claim_parts at a tiny size, so it cannot rot: every copy of composer_claim is
made from the migrated function's own source and claims its task, the figures are
positive, and no database is left behind; a source that no longer has the part a copy
replaces is refused, not measured under another name."""

from __future__ import annotations

import psycopg
import pytest

from bench import claim_parts
from bench.workload import make_template
from composer_ops.testing.servers import Server


def test_every_variant_claims_and_is_measured(server: Server) -> None:
    template = make_template(server, "bench_tpl_claim_parts_test")
    try:
        out = claim_parts.measure(server, template, claims=3, rounds=2)
    finally:
        server.drop_database(template)
    assert set(out["median"]) == {"engine, not registering", "engine, registering", "month function called directly",
                                  "pick as one statement", "both", "plain statement"}
    per = out["server_ms_per_claim"]
    assert all(len(v) == 2 and min(v) >= 0 for v in per.values())
    assert sum(sum(v) for v in per.values()) > 0      # (a backend's CPU read in 10 ms ticks may show 0 for 3 claims)
    assert out["over_engine"]["engine, not registering"] in (1.0, None)
    assert isinstance(out["cpu_exact"], bool)
    with psycopg.connect(server.admin_url) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'bench_claim_parts%%'").fetchall()
    assert left == []


def test_a_changed_function_is_refused() -> None:
    with pytest.raises(RuntimeError, match="composer_claim has changed: the pick"):
        claim_parts._replace("SELECT 1", claim_parts._PICK, claim_parts._ONE_PICK, "the pick")
    with pytest.raises(RuntimeError, match="the call of the month's function"):
        claim_parts._replace("SELECT 1", claim_parts._MONTH_CALL, "x", "the call of the month's function")
