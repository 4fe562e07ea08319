"""bench.mapitems (MAP items at scale, in `make bench`) at a tiny size, so it cannot rot:
each size's runs complete with their outputs, the sizes alternate their order, and
``largest_rounds`` keeps the largest size to its first rounds (`make bench` runs the
10,000-item case once)."""

from __future__ import annotations

from bench import mapitems
from composer_ops.testing.servers import Server


def test_the_largest_size_runs_in_its_first_rounds_only(server: Server) -> None:
    logged: list[str] = []
    out = mapitems.measure(server, sizes=(2, 5), rounds=3, events_at_least=4, largest_rounds=1,
                           log=logged.append)

    assert [(r["round"], r["size"]) for r in out["rounds"]] == [(0, 2), (0, 5), (1, 2), (2, 2)]
    assert logged == ["MAP of 2 items, round 1/3", "MAP of 5 items, round 1/3", "MAP of 2 items, round 2/3",
                      "MAP of 2 items, round 3/3"]
    for r in out["rounds"]:
        assert r["runs"] == (2 if r["size"] == 2 else 1)
        assert r["events"] == r["runs"] * r["size"] - r["runs"]   # the node's last event is apart
    assert out["event_ratio_by_size"]["2"] == 1.0
    assert set(out["event_ms_p50_by_size"]) == {"2", "5"}


def test_every_size_runs_in_every_round_by_default(server: Server) -> None:
    out = mapitems.measure(server, sizes=(2, 3), rounds=2, events_at_least=6, log=lambda _: None)
    assert [(r["round"], r["size"]) for r in out["rounds"]] == [(0, 2), (0, 3), (1, 3), (1, 2)]
