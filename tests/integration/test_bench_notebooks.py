"""bench.notebooks' runbook timing: every runbook is among its cases, each case runs as
`composer-ops runbook` does, and its record's own execution time is read; a runbook
refused before its kernel starts, or whose cell fails, is reported failed with its
error. (The 10-million-row build itself is `python -m bench.notebooks`, minutes long,
not run here.)"""

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
    found, refused = notebooks.time_runbooks(db_url, rounds=1, cases=[
        ("runbook find_run, a customer", "find_run", (("where", "input.customer=C-00042"),)),
        ("runbook sweeper_lag, refused", "sweeper_lag", (("sweeper_lag_s", "-5"),)),
    ])
    assert found["name"] == "runbook find_run, a customer" and found["ok"] and found["error"] is None
    assert found["notebook_seconds"] is not None and 0 < found["notebook_seconds"] < found["seconds"]
    assert len(found["seconds_each"]) == 1
    # Refused before a kernel starts: no record, so no notebook time.
    assert not refused["ok"] and "sweeper_lag_s" in refused["error"] and refused["notebook_seconds"] is None


def test_a_runbook_whose_cell_fails_is_reported_failed_with_its_record(db_url: str) -> None:
    """The kernel starts and its first read of the database fails (a database that does
    not exist): the record is kept, and the case is marked failed, with the error."""
    missing = db_url.replace(db_url.rsplit("/", 1)[1].split("?")[0], "composer_no_such_db")
    assert missing != db_url
    (failed,) = notebooks.time_runbooks(missing, rounds=1, cases=[("runbook sweeper_lag", "sweeper_lag", ())])
    assert not failed["ok"] and "composer_no_such_db" in failed["error"], failed
    assert failed["notebook_seconds"] is not None
