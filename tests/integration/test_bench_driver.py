"""bench.driver (the client's CPU per statement by the way it is sent) at a tiny size, so
it cannot rot: every way reads the row it asks for and is measured in every round."""

from __future__ import annotations

from bench import driver


def test_driver_measures_every_way_in_every_round(db_url: str) -> None:
    out = driver.measure(db_url, statements=5, rounds=2, log=lambda _: None)
    assert set(out["median"]) == set(driver.WAYS) == set(out["per_round"])
    assert all(len(rounds) == 2 for rounds in out["per_round"].values())
    assert all(m["client_us"] > 0 for m in out["median"].values())
