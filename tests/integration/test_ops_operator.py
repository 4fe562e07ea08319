"""The operator views in ``composer_ops.ops``: runs found by input, the workers
registry, the audit log, the command that unblocks a month, and a run read back from
its archive equal to the same run read from the database; the run investigation
report finds a run by its input and opens one whose month was dropped."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import psycopg
import pytest

from composer_ops import Engine, ops
from composer_ops.cli import main
from composer_ops.engine import archive
from composer_ops.errors import Invalid, NotFound
from composer_ops.testing import fixtures
from tests.integration.helpers import drop_months, seed_aligned


def _seeded(db_url: str) -> fixtures.SeedInfo:
    with psycopg.connect(db_url) as conn:
        info = seed_aligned(conn)
        conn.commit()
    return info


def test_find_runs_workers_and_audit_frames(db_url: str) -> None:
    info = _seeded(db_url)
    found = ops.find_runs(db_url, where={"order": "H1"})
    assert found["run_id"].to_list() == [info.runs["H1"]] and json.loads(found["input"][0]) == {"order": "H1"}
    assert ops.find_runs(db_url, where="input.order=H6", status="RUNNING")["run_id"].to_list() == [info.runs["H6"]]
    assert ops.find_runs(db_url, since="2025-01-01", until="2025-02-01").height == 3
    with pytest.raises(Invalid):
        ops.find_runs(db_url, where="order=H1")
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.register_worker("w-live", host="h", pid=1, queues=["default"], concurrency=2, heartbeat_s=600)
    registry, leases = ops.workers_frame(db_url)
    assert registry.filter(pl.col("worker") == "w-live")["state"].to_list() == ["live"]
    assert leases.columns[:3] == ["worker", "run_id", "node_id"]
    assert ops.audit_log(db_url).is_empty()
    assert ops.unblock_command("202412") == ("composer-ops runs cancel --since 2024-12-01 --until 2025-01-01 "
                                             "--status RUNNING,PENDING")


def test_an_archived_run_reads_back_as_it_was(db_url: str, tmp_path: Path) -> None:
    info = _seeded(db_url)
    run_id = info.runs["H3"]
    with psycopg.connect(db_url) as conn:
        now = ops.db_now(conn)
        live = ops.run_story(conn, run_id)
        conn.rollback()
        archive.export_month(conn, "202501", tmp_path)
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert drop_months(conn, datetime(2025, 2, 1, tzinfo=UTC)) == ["202412", "202501"]
    with pytest.raises(NotFound):
        ops.run_story(db_url, run_id)
    story = ops.archived_run_story(tmp_path, run_id, db_url, now=now)
    assert ops.archived_run_story(tmp_path, run_id, db_url).run_id == run_id      # the database's clock, in UTC
    same = ["run_id", "workflow_id", "workflow_version", "status", "created_at", "updated_at", "completed_at",
            "duration_s", "error"]
    assert story.run.select(same).rows() == live.run.select(same).rows()
    assert json.loads(story.run["input"][0]) == json.loads(live.run["input"][0])
    kept = [c for c in live.tasks.columns if c not in ("output",)]
    assert story.tasks.select(kept).rows() == live.tasks.select(kept).rows()
    assert story.nodes.rows() == live.nodes.rows() and story.edges.rows() == live.edges.rows()
    assert story.signals.rows() == live.signals.rows()
    with pytest.raises(NotFound):
        ops.archived_run_story(tmp_path, info.runs["H4"], db_url)      # February was not archived


def test_run_investigation_report_by_input_and_from_an_archive(db_url: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    info = _seeded(db_url)
    with psycopg.connect(db_url) as conn:
        archive.export_month(conn, "202501", tmp_path / "archive")
    with psycopg.connect(db_url, autocommit=True) as conn:
        drop_months(conn, datetime(2025, 2, 1, tzinfo=UTC))
    out = tmp_path / "reports"
    base = ["report", "run_investigation", "--out", str(out), "--database-url", db_url, "--progress", "0"]
    assert main([*base, "-p", "where", "input.order=H6"]) == 0, capsys.readouterr().err
    figures = json.loads(next((out / "run_investigation").glob("*.json")).read_text())
    assert figures["key_figures"]["run_id"] == info.runs["H6"]
    # Relative to the caller's directory, not the kernel's (which runs in the notebooks' folder).
    monkeypatch.chdir(tmp_path)
    assert main([*base, "-p", "run_id", info.runs["H2"], "-p", "archive_dir", "archive"]) == 0, \
        capsys.readouterr().err
    pages = sorted((out / "run_investigation").glob("*.html"))
    assert "archive " in pages[-1].read_text(encoding="utf-8")
    assert main([*base, "-p", "run_id", info.runs["H2"], "-p", "archive_dir", "nowhere"]) == 2
    assert "-p archive_dir: nowhere: no such directory (report run_investigation); nothing was run" in \
        capsys.readouterr().err
    assert len(sorted((out / "run_investigation").glob("*.html"))) == len(pages)
    assert main([*base, "-p", "where", "order=1"]) == 2
    assert "where: value 'order=1': at column 1" in capsys.readouterr().err
