"""Operator actions retried while their first attempt is still committing.

The fault proxy holds the first attempt's COMMIT back from the server and cuts the
client's connection, so the action retries on a new one while the first attempt's
transaction still holds its locks; the COMMIT goes through once the retry waits for
one of them (``Fault.HOLD_COMMIT``). A retry that looks for its request's record
before taking the lock that serialises it with the first attempt finds nothing and
then sees the first attempt's effect as someone else's. Each action here must take
that lock first, and report what its own first attempt did.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.engine import archive, retire
from composer_ops.engine.retention import drop_due_months
from composer_ops.repo import partitions
from composer_ops.testing.faultproxy import Fault, FaultProxy, Request
from tests.integration.helpers import drop_months, seed_aligned

pytestmark = [pytest.mark.timeout(180)]

CHAIN = {"id": "h-chain", "nodes": [
    {"id": "a", "type": "TASK", "task": "t", "queue": "hq"},
    {"id": "b", "type": "TASK", "task": "t", "queue": "hq", "depends_on": ["a"]}]}
DUE = ["202412", "202501", "202503"]          # the seed's months the plan drops at 2025-05-01


@pytest.fixture
def proxy(db_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(db_url, hold_max_s=120) as p:
        yield p


def commit_after(proxy: FaultProxy, needle: str) -> Callable[[Request], bool]:
    """A match for the COMMIT of the first transaction that sent a statement containing
    ``needle`` (on the same connection, since its BEGIN)."""
    def match(r: Request) -> bool:
        if r.text != "COMMIT":
            return False
        for q in reversed([q for q in proxy.requests if q.conn == r.conn and q.index < r.index]):
            if needle in q.text:
                return True
            if q.text.startswith(("BEGIN", "COMMIT", "ROLLBACK")):
                return False
        return False
    return match


def _held(proxy: FaultProxy) -> Request:
    """The held COMMIT, once the server answered it: it committed."""
    assert proxy.wait_released(60)
    fired = proxy.fired
    assert fired is not None and fired.fault is Fault.HOLD_COMMIT and fired.commits, fired
    return fired


def _audit(db_url: str, action: str) -> list[tuple[str, str | None]]:
    with psycopg.connect(db_url) as conn:
        return [(str(t), r) for t, r in conn.execute(
            "SELECT target, request FROM operator_audit WHERE action = %s ORDER BY id", (action,))]


def _seeded(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        seed_aligned(conn)
        conn.commit()


def _months(db_url: str) -> set[str]:
    with psycopg.connect(db_url) as conn:
        return {p.month for p in partitions.list_partitions(conn)}


def test_a_bulk_cancel_chunk_retried_while_it_commits_reports_its_runs(db_url: str, proxy: FaultProxy) -> None:
    with Engine.connect(db_url, pool_size=1) as direct, Engine.connect(proxy.url(), pool_size=1) as e:
        direct.deploy(CHAIN)
        token = uuid.uuid4().hex
        started = sorted(direct.start("h-chain", input={"token": token}) for _ in range(3))
        proxy.arm(Fault.HOLD_COMMIT, match=commit_after(proxy, "INSERT INTO operator_audit"))
        try:
            result = e.cancel_runs(where={"token": token}, yes=True, chunk=5)
        finally:
            proxy.release()
        _held(proxy)
        statuses = {direct.get_run(r).status for r in started}
    assert (sorted(result.cancelled), result.skipped) == (started, [])
    assert [c.duplicate for c in result.chunks] == [True]
    assert len(_audit(db_url, "runs cancel")) == 1 and statuses == {"CANCELLED"}


def test_a_run_retry_retried_while_it_commits_returns_what_it_did(db_url: str, proxy: FaultProxy) -> None:
    with Engine.connect(db_url, pool_size=1) as direct, Engine.connect(proxy.url(), pool_size=1) as e:
        direct.deploy(CHAIN)
        run_id = direct.start("h-chain")
        claims = direct.claim(["hq"], "w", 1)
        direct.fail(claims[0], "fatal", retryable=False)
        proxy.arm(Fault.HOLD_COMMIT, match=commit_after(proxy, "INSERT INTO operator_audit"))
        try:
            result = e.retry(run_id)
        finally:
            proxy.release()
        _held(proxy)
        run = direct.get_run(run_id)
    assert (result.applied, result.duplicate, result.reset) == (True, True, ("a",))
    assert run.status == "RUNNING" and [(t.node_id, t.state) for t in run.tasks] == [("a", "PENDING")]
    assert _audit(db_url, "runs retry") == [(run_id, _audit(db_url, "runs retry")[0][1])]


def test_a_partitions_drop_retried_while_it_commits_reports_the_months(db_url: str, proxy: FaultProxy) -> None:
    _seeded(db_url)
    proxy.arm(Fault.HOLD_COMMIT, match=commit_after(proxy, "INSERT INTO retention_drops"))
    try:
        result = drop_due_months(proxy.url(), "2025-05-01")
    finally:
        proxy.release()
    _held(proxy)
    assert (result.dropped, result.duplicate, result.attempts) == (DUE, True, 2)
    assert not set(DUE) & _months(db_url)


def test_a_drop_with_archive_retried_while_it_commits_reports_the_month_dropped(
        db_url: str, proxy: FaultProxy, tmp_path: Path) -> None:
    _seeded(db_url)
    proxy.arm(Fault.HOLD_COMMIT, match=commit_after(proxy, "INSERT INTO retention_drops"))
    try:
        result = retire.retire_months(proxy.url(), "2025-05-01", archive_dir=tmp_path, yes=True)
    finally:
        proxy.release()
    _held(proxy)
    assert [(m.month, m.outcome, m.duplicate) for m in result.months] == [
        ("202412", "dropped", True), ("202501", "dropped", False), ("202503", "dropped", False)]
    assert [t for t, _ in _audit(db_url, "partitions drop")] == DUE
    assert not set(DUE) & _months(db_url)


def test_a_restore_retried_while_it_commits_replays_its_audit_row(db_url: str, proxy: FaultProxy,
                                                                  tmp_path: Path) -> None:
    _seeded(db_url)
    with psycopg.connect(db_url) as conn:
        archive.export_month(conn, "202501", tmp_path)
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert drop_months(conn, datetime(2025, 2, 1, tzinfo=UTC)) == ["202412", "202501"]
    proxy.arm(Fault.HOLD_COMMIT, match=commit_after(proxy, "INSERT INTO operator_audit"))
    try:
        result = archive.restore_month(proxy.url(), "202501", tmp_path, yes=True)
    finally:
        proxy.release()
    _held(proxy)
    assert (result.applied, result.duplicate) == (True, True)
    assert [(t.table, t.rows) for t in result.tables][:2] == [("workflow_runs", 3), ("task_instances", 9)]
    assert [t for t, _ in _audit(db_url, "partitions restore")] == ["202501"]
    assert "202501" in _months(db_url)
