"""bench.driver (the client's CPU per statement by the way it is sent) at a tiny size, so
it cannot rot: every way reads the row it asks for and is measured in every round."""

from __future__ import annotations

from bench import driver


def test_driver_measures_every_way_in_every_round(db_url: str) -> None:
    out = driver.measure(db_url, statements=5, rounds=2, log=lambda _: None)
    assert set(out["median"]) == set(driver.WAYS) == set(out["per_round"])
    assert all(len(rounds) == 2 for rounds in out["per_round"].values())
    assert all(m["client_us"] > 0 and m["server_us"] is not None for m in out["median"].values())
    assert out["psycopg"] and out["psycopg_build"] in ("c", "binary", "python")
    assert driver.table({**out, "server_version": "test"}).row_count == len(driver.WAYS)


def test_driver_reads_no_server_cpu_of_a_server_elsewhere(db_url: str) -> None:
    out = driver.measure(db_url, statements=2, rounds=1, log=lambda _: None, server_local=False)
    assert all(m["server_us"] is None for m in out["median"].values())
    assert out["backend_time_exact"] is None
    assert driver.table({**out, "server_version": "test"}).row_count == len(driver.WAYS)
