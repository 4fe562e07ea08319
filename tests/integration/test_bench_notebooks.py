"""bench.notebooks' runbook timing: every runbook is among its cases, each case runs as
`composer-ops runbook` does, and its record's own execution time is read; a runbook that
fails is reported failed, not timed as a success. (The 10-million-row build itself is
`python -m bench.notebooks`, minutes long, not run here.)"""

from __future__ import annotations

from bench import notebooks
from composer_ops.runbooks.catalogue import RUNBOOKS


def test_the_cases_cover_every_runbook_and_find_run_as_an_incident_asks() -> None:
    cases = notebooks.runbook_cases()
    assert {name for _, name, _ in cases} == {r.name for r in RUNBOOKS}
    assert len({label for label, _, _ in cases}) == len(cases)
    wheres = [dict(params).get("where") for _, name, params in cases if name == "find_run"]
    assert None in wheres and "input.order_id=ORD-NONE" in wheres


def test_a_runbook_is_timed_from_its_record_and_a_failing_one_is_reported(db_url: str) -> None:
    got = notebooks.time_runbooks(db_url, rounds=1, cases=[
        ("runbook find_run, a customer", "find_run", (("where", "input.customer=C-00042"),)),
        ("runbook sweeper_lag, refused", "sweeper_lag", (("sweeper_lag_s", "-5"),)),
    ])
    found, refused = got
    assert found["name"] == "runbook find_run, a customer" and found["ok"] and found["error"] is None
    assert found["notebook_seconds"] is not None and 0 < found["notebook_seconds"] < found["seconds"]
    assert len(found["seconds_each"]) == 1
    assert not refused["ok"] and "sweeper_lag_s" in refused["error"] and refused["notebook_seconds"] is None
