"""``runs cancel``: a dry run lists and writes nothing; --yes cancels the selected active
runs through the engine's cancel event, in chunks with an audit row each; interrupted
and run again, every run is cancelled exactly once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.engine.admin import CancelChunk
from composer_ops.errors import Invalid

SPEC = {"id": "shop", "nodes": [
    {"id": "pay", "type": "TASK", "task": "pay"},
    {"id": "wait", "type": "WAIT_FOR_SIGNAL", "signal": "go", "depends_on": ["pay"]}]}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    with Engine.connect(db_url, pool_size=4) as e:
        e.deploy(SPEC)
        e.deploy({"id": "other", "nodes": [{"id": "a", "type": "TASK", "task": "pay"}]})
        yield e


def _start(engine: Engine, n: int, customer: int, workflow: str = "shop") -> list[str]:
    return [engine.start(workflow, input={"customer": customer, "i": i}) for i in range(n)]


def _audit(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT action, counts, detail, request FROM operator_audit ORDER BY id").fetchall()


def _statuses(engine: Engine, run_ids: list[str]) -> set[str]:
    return {engine.get_run(r).status for r in run_ids}


def test_dry_run_lists_and_writes_nothing_then_yes_cancels_in_chunks(db_url: str, engine: Engine) -> None:
    target = _start(engine, 7, customer=42)
    spared = _start(engine, 3, customer=7) + _start(engine, 2, customer=42, workflow="other")
    finished = _start(engine, 1, customer=42)
    engine.cancel(finished[0])
    dry = engine.cancel_runs(where="input.customer=42", workflow="shop")
    assert (dry.applied, dry.would_cancel, dry.more) == (False, sorted(target), False)
    assert _statuses(engine, target) == {"RUNNING"} and _audit(db_url) == []
    seen: list[CancelChunk] = []
    done = engine.cancel_runs(where="input.customer=42", workflow="shop", yes=True, chunk=3, reason="recall",
                              on_chunk=seen.append)
    assert sorted(done.cancelled) == sorted(target) and done.skipped == []
    assert [len(c.cancelled) for c in done.chunks] == [3, 3, 1] and seen == done.chunks
    assert _statuses(engine, target) == {"CANCELLED"} and _statuses(engine, spared) == {"RUNNING"}
    run = engine.get_run(target[0])
    assert run.error == {"error": "recall"} and {t.state for t in run.tasks} == {"CANCELLED"}
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM task_outbox WHERE run_id = ANY(%s)", (target,)).fetchone() == (0,)
    rows = _audit(db_url)
    assert [(a, c) for a, c, _, _ in rows] == [
        ("runs cancel", {"cancelled": 3, "skipped": 0, "chunk": 1}),
        ("runs cancel", {"cancelled": 3, "skipped": 0, "chunk": 2}),
        ("runs cancel", {"cancelled": 1, "skipped": 0, "chunk": 3})]
    assert len({r.split(":")[0] for *_, r in rows}) == 1          # one request, one row per chunk
    again = engine.cancel_runs(where="input.customer=42", workflow="shop", yes=True)
    assert again.cancelled == [] and again.chunks == []           # nothing active is left to cancel
    assert len(_audit(db_url)) == 3


def test_interrupted_and_run_again_cancels_each_run_exactly_once(db_url: str, engine: Engine) -> None:
    target = _start(engine, 10, customer=5)

    def interrupt(chunk: CancelChunk) -> None:
        if chunk.number == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.cancel_runs(where="input.customer=5", yes=True, chunk=4, on_chunk=interrupt)
    assert sorted(engine.get_run(r).status for r in target) == ["CANCELLED"] * 8 + ["RUNNING"] * 2
    rest = engine.cancel_runs(where="input.customer=5", yes=True, chunk=4)
    assert len(rest.cancelled) == 2 and _statuses(engine, target) == {"CANCELLED"}
    cancelled = [r for _, _, detail, _ in _audit(db_url) for r in detail["cancelled"]]
    assert sorted(cancelled) == sorted(target)                   # each run once, across both commands


def test_a_run_finished_between_listing_and_locking_is_skipped(db_url: str, engine: Engine,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    target = _start(engine, 3, customer=9)
    from composer_ops.repo import runs

    real = runs.find_runs

    def listed_then_finished(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        if found:
            with psycopg.connect(db_url) as other:     # another session finishes the first one
                other.execute("UPDATE workflow_runs SET status = 'SUCCEEDED' WHERE id = %s", (found[0].id,))
        return found

    monkeypatch.setattr(runs, "find_runs", listed_then_finished)
    done = engine.cancel_runs(where="input.customer=9", yes=True)
    assert done.skipped == [sorted(target)[0]] and sorted(done.cancelled) == sorted(target)[1:]


def test_cli_runs_cancel(db_url: str, engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    target = _start(engine, 2, customer=3)
    base = ["runs", "cancel", "--database-url", db_url, "--where", "input.customer=3"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert all(f"would cancel {r}" in out for r in target) and "nothing was changed" in out
    assert main([*base, "--yes", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["cancelled"]) == sorted(target) and out["applied"] is True
    (action, counts, _, _), = _audit(db_url)
    assert (action, counts["cancelled"]) == ("runs cancel", 2)
    with psycopg.connect(db_url) as conn:
        command, = conn.execute("SELECT command FROM operator_audit").fetchone()  # type: ignore[misc]
    assert command.startswith("composer-ops runs cancel --database-url ") and "--where input.customer=3" in command
    password = conninfo_to_dict(db_url).get("password")      # the embedded server's URL has one, a cluster's not
    assert password is None or (password not in command and ":***@" in command)
    assert main(["runs", "cancel", "--database-url", db_url]) == 2               # no selection: refused
    assert "say which runs" in capsys.readouterr().err
    assert main([*base, "--status", "FAILED"]) == 2
    with pytest.raises(Invalid):
        engine.cancel_runs(where="input.customer=3", chunk=0)


def test_runs_no_event_can_be_decided_on_are_refused_in_the_dry_run_and_for_real(
        db_url: str, engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    """Odd data: a run with a task in a state the engine does not know, and a run whose
    definition version does not exist. Before, the dry run listed both as cancellable,
    the cancel skipped the second as 'finished meanwhile' and stopped the whole command
    on the first (exit 2, later chunks not cancelled). Now the first is refused with why,
    in the dry run too, and the command exits 1; the second is cancelled on a stand-in of
    its definition (its tasks' kinds), and so are the others."""
    plain, no_definition, odd_state, later = _start(engine, 4, customer=5)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE workflow_runs SET workflow_version = 99 WHERE id = %s", (no_definition,))
        conn.execute("UPDATE task_instances SET state = 'WEIRD' WHERE run_id = %s", (odd_state,))
    args = ["runs", "cancel", "--where", "input.customer=5", "--chunk", "1", "--database-url", db_url]
    assert main(args) == 1              # the dry run says it would refuse one, and exits as the cancel will
    assert f"would refuse run {odd_state}" in capsys.readouterr().out
    assert main([*args, "--json"]) == 1
    dry = json.loads(capsys.readouterr().out)
    # Runs started in one millisecond are in ID order, not start order: compared as sets.
    assert sorted(dry["would_cancel"]) == sorted([plain, no_definition, later])
    assert [r["run_id"] for r in dry["refused"]] == [odd_state]
    assert "is in state 'WEIRD', which the engine does not know" in dry["refused"][0]["error"]
    assert _statuses(engine, [plain, later]) == {"RUNNING"} and _audit(db_url) == []
    assert main([*args, "--yes"]) == 1
    out = capsys.readouterr().out
    assert f"refused run {odd_state}: run {odd_state}: task " in out
    assert out.rstrip().endswith("cancelled 3 run(s) in 4 transaction(s), refused 1 (above)"), out
    assert _statuses(engine, [plain, later]) == {"CANCELLED"}
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT id, status FROM workflow_runs WHERE id = ANY(%s)",
                            ([no_definition, odd_state],)).fetchall()
        states: dict[str, str] = dict(rows)
        tasks = conn.execute("SELECT state FROM task_instances WHERE run_id = %s", (no_definition,)).fetchall()
    assert states == {no_definition: "CANCELLED", odd_state: "RUNNING"} and tasks == [("CANCELLED",)]
    assert main(["cancel", odd_state, "--database-url", db_url]) == 1      # one run: the same, one line
    err = capsys.readouterr().err
    assert "repair the task's row (its state) first" in err and err.count("\n") == 1, err
    assert main(["signal", no_definition, "go", "--database-url", db_url]) == 1   # a cancel only
    assert "no event but a cancel can be decided on it" in capsys.readouterr().err


def test_a_role_that_may_only_read_gets_the_dry_run_listed_not_decided(
        db_url: str, engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    """A decided dry run takes the runs' locks, which the read-only role may not: it gets
    the runs the selection holds, listed, and told so (before, every dry run only listed)."""
    from tests.notebooks.harness import as_role

    runs = _start(engine, 2, customer=6)
    assert main(["runs", "cancel", "--where", "input.customer=6", "--database-url", as_role(db_url)]) == 0
    out = capsys.readouterr().out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("would cancel ")][:2] == sorted(runs)
    assert "listed, not decided: this role may only read" in out
    assert _statuses(engine, runs) == {"RUNNING"}
