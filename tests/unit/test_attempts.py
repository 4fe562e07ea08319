"""Attempts read from a run's history (composer_ops.core.attempts), without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from composer_ops.core.attempts import HistoryRow, attempts, lost_leases

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(s: int) -> datetime:
    return T0 + timedelta(seconds=s)


def row(s: int, kind: str, node_id: str | None = None, task_id: str | None = None, attempt: int | None = None,
        worker: str | None = None, detail: Any = None) -> HistoryRow:
    """The run's ``s``-th history row, written ``s`` seconds after T0."""
    return HistoryRow(seq=s, at=at(s), kind=kind, node_id=node_id, task_id=task_id, attempt=attempt, worker=worker,
                      request=None, detail=detail)


def test_each_attempt_is_opened_by_its_claim_and_ended_by_what_ended_it() -> None:
    rows = [
        row(0, "started"),
        row(1, "claimed", "a", "t1", 0, "w1"),
        row(5, "lease_expired", "a", "t1", 0, "w1", {"error": "lease of w1 expired", "requeued": True}),
        row(6, "lease_lost", "a", "t1", 0, "w1", {"reason": "heartbeat found the lease lost"}),
        row(7, "claimed", "a", "t1", 1, "w2"),
        row(8, "failed", "a", "t1", 1, "w2", {"error": "boom", "requeued": False, "finished": "FAILED"}),
        row(9, "retried", detail={"from": [], "reset": ["a"]}),
        row(10, "claimed", "a", "t2", 0, "w3"),
        row(11, "claimed", "b", "t3", 0, "w3"),
        row(12, "completed", "b", "t3", 0, "w3"),
        row(13, "cancelled", detail={"reason": "enough"}),
    ]
    found = attempts(rows)
    assert [(a.node_id, a.task_id, a.attempt, a.worker, a.outcome, a.requeued) for a in found] == [
        ("a", "t1", 0, "w1", "lease expired", True),
        ("a", "t1", 1, "w2", "failed", False),
        ("a", "t2", 0, "w3", "cancelled", None),
        ("b", "t3", 0, "w3", "completed", None),
    ]
    assert found[0].lost == "heartbeat found the lease lost" and found[0].ended_at == at(5)
    assert found[1].error == "boom" and (found[1].claimed_at, found[1].ended_at) == (at(7), at(8))
    assert found[2].ended_at == at(13) and found[3].ended_at == at(12)
    assert [(a.task_id, a.worker) for a in lost_leases(rows)] == [("t1", "w1")]


def test_an_attempt_without_its_claim_row_still_names_the_worker_that_ended_it() -> None:
    [only] = attempts([row(3, "lease_expired", "a", "t1", 0, "w9", {"requeued": True, "error": "x"})])
    assert (only.worker, only.claimed_at, only.outcome) == ("w9", None, "lease expired")
    assert attempts([row(1, "signal", "w", "t5", None, None, {"name": "go"})]) == []


def test_attempts_after_a_retry_carry_the_retry_generation() -> None:
    at = datetime(2025, 1, 1, tzinfo=UTC)

    def row(seq: int, kind: str, task: str | None = None, attempt: int | None = None) -> HistoryRow:
        return HistoryRow(seq=seq, at=at, kind=kind, node_id="a" if task else None, task_id=task, attempt=attempt,
                          worker="w", request=None, detail={"requeued": False} if kind == "failed" else {})

    found = attempts([row(1, "claimed", "t1", 0), row(2, "failed", "t1", 0), row(3, "retried"),
                      row(4, "claimed", "t2", 0), row(5, "failed", "t2", 0), row(6, "retried"),
                      row(7, "claimed", "t3", 0)])
    assert [(a.task_id, a.attempt, a.retry, a.label) for a in found] == [
        ("t1", 0, 0, "0"), ("t2", 0, 1, "0 (retry 1)"), ("t3", 0, 2, "0 (retry 2)")]


def test_tasks_cancelled_as_a_node_failed_end_only_their_nodes_attempts() -> None:
    rows = [
        row(1, "claimed", "slow", "t1", 0, "w1"),
        row(2, "claimed", "map", "i1", 0, "w1"),
        row(3, "claimed", "other", "t3", 0, "w2"),
        row(4, "cancelled", detail={"reason": "node map failed", "tasks": 2, "nodes": ["map", "slow"]}),
    ]
    assert [(a.task_id, a.outcome, a.ended_at) for a in attempts(rows)] == [
        ("t1", "cancelled", at(4)), ("i1", "cancelled", at(4)), ("t3", "running", None)]
