"""composer_ops.ops.anomalies: odd rows turned into what a report lists (no database)."""

from __future__ import annotations

import polars as pl

from composer_ops.ops import anomalies
from composer_ops.ops._common import rows_frame
from composer_ops.ops.active import DEFINITION_MISMATCH_SCHEMA
from composer_ops.ops.display import anomaly_figures

RUN = "0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e8f"
OTHER = "0190b6c8-5a3e-7d2c-9f1e-3b4a5c6d7e90"


def _mismatches(*rows: tuple[object, ...]) -> pl.DataFrame:
    """Rows of ``ops.definition_mismatches`` (the fields anomalies read, the rest empty)."""
    full = [(*r, None, None) for r in rows]
    return rows_frame(full, DEFINITION_MISMATCH_SCHEMA)


def test_definition_mismatches_become_one_anomaly_each_with_the_kinds_of_run() -> None:
    found = anomalies.definitions(_mismatches(
        (RUN, "nightly-report", 1, "RUNNING", "extract_a", "TASK", 1, "PENDING"),
        (RUN, "nightly-report", 1, "RUNNING", "fan", "MAP", 4, "PENDING, RUNNING, WAITING"),
        (OTHER, "order-fulfilment", 9, "RUNNING", None, None, 2, "PENDING, RUNNING"),
    ))
    assert anomaly_figures(found) == sorted([
        f"task for a node not in its definition: run {RUN}, node extract_a",
        f"task for a node not in its definition: run {RUN}, node fan",
        f"definition version missing: run {OTHER}",
    ])
    node, items, run = found
    assert node.detail.startswith("nightly-report v1 has no node 'extract_a' (1 active task: PENDING; run RUNNING):")
    assert "(4 active tasks: PENDING, RUNNING, WAITING; run RUNNING)" in items.detail
    assert run.detail.startswith("the run started on order-fulfilment v9, which is not in workflow_definitions "
                                 "(2 active tasks: PENDING, RUNNING; run RUNNING):")
    assert "run_investigation" in node.action and "composer-ops cancel RUN" in run.action
    # The same kinds as the one-run check of run_investigation, so the index and the figures
    # name one concept one way.
    one_run = anomalies.run(False, "order-fulfilment", 9, [], OTHER) + anomalies.run(
        True, "nightly-report", 1, ["extract_a"], RUN)
    assert {a.kind for a in one_run} == {a.kind for a in found}


def test_no_mismatch_is_no_anomaly() -> None:
    assert anomalies.definitions(_mismatches()) == []


def test_the_one_run_check_reads_as_before() -> None:
    (missing,) = anomalies.run(False, "order-fulfilment", 3, ["legacy_audit"], RUN)
    (unknown,) = anomalies.run(True, "order-fulfilment", 3, ["legacy_audit"], RUN)
    assert missing.detail == ("the run started on order-fulfilment v3, which is not in workflow_definitions: "
                              "the coordinator cannot load it to decide the next step")
    assert unknown.subject == f"run {RUN}, node legacy_audit"
    assert unknown.detail.startswith("order-fulfilment v3 has no node 'legacy_audit': the task was written")
    assert anomalies.run(True, "order-fulfilment", 1, [], RUN) == []


def test_a_run_whose_version_is_missing_is_one_anomaly_not_one_per_node() -> None:
    """Without its definition every node of the run reads as "not in its definition":
    the run investigation listed each (noise an on-call tester met); the missing version
    is the one finding."""
    found = anomalies.run(False, "order-fulfilment", 99, ["charge", "ship"], RUN)
    assert [(a.kind, a.subject) for a in found] == [("definition version missing", f"run {RUN}")]
    found = anomalies.run(True, "order-fulfilment", 1, ["ghost"], RUN)
    assert [(a.kind, a.subject) for a in found] == [("task for a node not in its definition", f"run {RUN}, node ghost")]
