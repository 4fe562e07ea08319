"""Soft-deleting finished runs, and pruning delivered webhooks: a deleted run is gone
from every read, loop and claim, stays until its month is dropped (and never keeps
that month), and only finished runs can be deleted; deliveries finished more than
N days ago are deleted by the coordinator, pending ones never."""

from __future__ import annotations

import json

import psycopg
import pytest

from composer_ops import Conflict, Engine, NotFound
from composer_ops.cli import main
from composer_ops.engine.retention import drop_due_months
from tests.receiver import Receiver

ONE = {"id": "del", "nodes": [{"id": "a", "type": "TASK", "task": "t", "queue": "dq"}]}


@pytest.fixture
def engine(engine: Engine) -> Engine:
    engine.deploy(ONE)
    return engine


def _finished(engine: Engine) -> str:
    run_id = engine.start("del")
    (claim,) = engine.claim(["dq"], "w", 1)
    engine.complete(claim, {"ok": True})
    assert engine.get_run(run_id).status == "SUCCEEDED"
    return run_id


def _sql(db_url: str, query: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def test_a_finished_run_is_deleted_once_and_disappears_from_reads(engine: Engine, db_url: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run_id = _finished(engine)
    done = engine.delete_run(run_id)
    assert (done.status, done.already) == ("SUCCEEDED", False)
    with pytest.raises(NotFound):
        engine.get_run(run_id)
    again = engine.delete_run(run_id)                     # a retried call changes nothing
    assert again.already and again.deleted_at == done.deleted_at
    assert main(["runs", "show", run_id, "--database-url", db_url]) == 2      # NotFound, as for any unknown ID
    assert "does not exist" in capsys.readouterr().err
    # the row stays (its month's drop removes it) and never keeps its month
    assert _sql(db_url, "SELECT status, deleted_at IS NOT NULL FROM workflow_runs WHERE id = %s", (run_id,)) == [
        ("SUCCEEDED", True)]
    plan = drop_due_months(db_url, "2000-01-01").plan
    assert all(m.reason != "has active runs" for m in plan)


def test_an_active_run_cannot_be_deleted(engine: Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    run_id = engine.start("del")
    with pytest.raises(Conflict, match="only finished runs can be deleted"):
        engine.delete_run(run_id)
    assert main(["runs", "delete", run_id, "--database-url", db_url]) == 1
    assert main(["runs", "delete", run_id, "--yes", "--database-url", db_url]) == 1
    err = capsys.readouterr().err
    assert err.count("cancel it first") == 2 and "Traceback" not in err
    assert engine.get_run(run_id).status == "RUNNING"


def test_the_cli_is_a_dry_run_unless_yes(engine: Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    run_id = _finished(engine)
    assert main(["runs", "delete", run_id, "--database-url", db_url]) == 0
    assert "would delete run" in capsys.readouterr().out
    assert engine.get_run(run_id).status == "SUCCEEDED"
    assert main(["runs", "delete", run_id, "--yes", "--json", "--database-url", db_url]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["run_id"], record["action"], record["status"]) == (run_id, "deleted", "SUCCEEDED")
    assert main(["runs", "delete", run_id, "--yes", "--database-url", db_url]) == 0
    assert "was already deleted" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:                     # argparse's one line, before connecting
        main(["runs", "delete", "not-a-run-id", "--yes", "--database-url", db_url])
    assert bad.value.code == 2 and "argument RUN: run id 'not-a-run-id' is not a UUID" in capsys.readouterr().err
    # A pasted spelling of the run's ID (upper case, braces) names the same run.
    assert main(["runs", "delete", "{" + run_id.upper() + "}", "--yes", "--database-url", db_url]) == 0
    assert f"run {run_id} (SUCCEEDED) was already deleted" in capsys.readouterr().out


def test_the_claim_skips_a_deleted_run(engine: Engine, db_url: str) -> None:
    """Deleted runs are finished and have no dispatch left; one marked deleted by hand
    while it still had one is not claimed, and its dispatch is consumed."""
    run_id = engine.start("del")
    _sql(db_url, "UPDATE workflow_runs SET deleted_at = now() WHERE id = %s", (run_id,))
    assert engine.claim(["dq"], "w", 5) == []
    assert _sql(db_url, "SELECT count(*) FROM task_outbox") == [(0,)]
    assert _sql(db_url, "SELECT state FROM task_instances WHERE run_id = %s", (run_id,)) == [("PENDING",)]


def test_deleting_gives_up_a_pending_webhook(db_url: str) -> None:
    posts = Receiver(lambda request, body: 204)
    try:
        with Engine.connect(db_url, pool_size=2) as engine:
            engine.deploy({**ONE, "id": "del-hook", "webhook_url": posts.url("/hook")})
            run_id = engine.start("del-hook")
            (claim,) = engine.claim(["dq"], "w", 1)
            engine.complete(claim, None)
            assert engine.delete_run(run_id).webhooks_given_up == 1
            stats = engine.coordinator().run_once(["webhooks"])
        assert stats.webhooks_delivered == 0 and posts.requests == []
        assert _sql(db_url, "SELECT gave_up_at IS NOT NULL, last_error FROM webhook_deliveries") == [
            (True, "run deleted before its webhook was delivered")]
    finally:
        posts.close()


def test_the_coordinator_prunes_deliveries_finished_more_than_n_days_ago(engine: Engine, db_url: str) -> None:
    engine.deploy({**ONE, "id": "del-hook", "webhook_url": "http://127.0.0.1:9/never"})
    runs = []
    for _ in range(5):
        run_id = engine.start("del-hook")
        (claim,) = engine.claim(["dq"], "w", 1)
        engine.complete(claim, None)
        runs.append(run_id)
    old_delivered, old_given_up, new_delivered, pending, old_pending = runs
    _sql(db_url, "UPDATE webhook_deliveries SET delivered_at = now() - interval '8 days' WHERE run_id = %s",
         (old_delivered,))
    _sql(db_url, "UPDATE webhook_deliveries SET gave_up_at = now() - interval '9 days' WHERE run_id = %s",
         (old_given_up,))
    _sql(db_url, "UPDATE webhook_deliveries SET delivered_at = now() - interval '1 day' WHERE run_id = %s",
         (new_delivered,))
    _sql(db_url, "UPDATE webhook_deliveries SET created_at = now() - interval '30 days', "
                 "next_attempt_at = now() + interval '1 hour' WHERE run_id IN (%s, %s)", (pending, old_pending))
    assert engine.coordinator(webhook_keep_days=None).run_once(["webhooks"]).webhooks_pruned == 0
    stats = engine.coordinator(webhook_keep_days=7).run_once(["webhooks"])
    assert stats.webhooks_pruned == 2 and stats.errors == []
    left = {r[0] for r in _sql(db_url, "SELECT run_id FROM webhook_deliveries")}
    assert left == {new_delivered, pending, old_pending}


def test_pruning_goes_in_batches(engine: Engine, db_url: str) -> None:
    """Each batch is its own transaction; a pass stops after its last batch and the
    rest waits for the next pass."""
    engine.deploy({**ONE, "id": "del-hook", "webhook_url": "http://127.0.0.1:9/never"})
    for _ in range(7):
        engine.start("del-hook")
        (claim,) = engine.claim(["dq"], "w", 1)
        engine.complete(claim, None)
    _sql(db_url, "UPDATE webhook_deliveries SET delivered_at = now() - interval '8 days'")
    coordinator = engine.coordinator()
    stats = coordinator.run_once([])
    coordinator._prune_webhooks(stats, batch=3, max_batches=2)      # 6 of the 7
    assert stats.webhooks_pruned == 6
    coordinator._prune_webhooks(stats, batch=3, max_batches=2)      # more were left: due again at once
    assert stats.webhooks_pruned == 7
    coordinator._prune_webhooks(stats, batch=3, max_batches=2)      # all done: not before the next hour
    assert stats.webhooks_pruned == 7 and _sql(db_url, "SELECT count(*) FROM webhook_deliveries") == [(0,)]
