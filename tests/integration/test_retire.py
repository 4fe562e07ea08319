"""``partitions drop --archive DIR`` (archive each month, drop it only once its archive
verified and its rows are unchanged) and ``partitions detach`` (keep the months as
standalone tables): month by month, audited, nothing written on a dry run."""

from __future__ import annotations

import json
import threading
from datetime import date
from pathlib import Path
from typing import Any

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.core.manifest import BadArchive
from composer_ops.engine import archive, retire
from composer_ops.errors import ComposerError
from composer_ops.repo import partitions
from composer_ops.testing import fixtures
from tests.integration.helpers import seed_aligned

DUE = ["202412", "202501", "202503"]          # the seed's months the plan drops at 2025-05-01


def _seeded(db_url: str) -> fixtures.SeedInfo:
    with psycopg.connect(db_url) as conn:
        info = seed_aligned(conn)
        conn.commit()
    return info


def _months(db_url: str) -> set[str]:
    with psycopg.connect(db_url) as conn:
        return {p.month for p in partitions.list_partitions(conn)}


def _audit(db_url: str) -> list[tuple[str, str]]:
    with psycopg.connect(db_url) as conn:
        return [(a, t) for a, t in conn.execute("SELECT action, target FROM operator_audit ORDER BY id")]


def _drop(db_url: str, target: Path, *extra: str) -> int:
    return main(["partitions", "drop", "--older-than", "2025-05-01", "--archive", str(target), "--database-url",
                 db_url, *extra])


def test_drop_with_archive_month_by_month(db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _seeded(db_url)
    assert _drop(db_url, tmp_path / "a", "--json") == 3               # months kept for active runs: exit 3
    out = json.loads(capsys.readouterr().out)
    assert [(m["month"], m["outcome"]) for m in out["months"]] == [(m, "would drop") for m in DUE]
    assert not (tmp_path / "a").exists() and _audit(db_url) == [] and set(DUE) <= _months(db_url)
    assert _drop(db_url, tmp_path / "a", "--yes") == 3
    captured = capsys.readouterr()
    assert "retention blocked: 202502 kept for 1 active run" in captured.err
    assert all(f"dropped {m}" in captured.out for m in DUE)
    assert not set(DUE) & _months(db_url) and {"202502", "202504"} <= _months(db_url)
    for month in DUE:
        assert archive.verify_month(tmp_path / "a" / month).month == month
    assert _audit(db_url) == [x for m in DUE for x in (("partitions archive", m), ("partitions drop", m))]
    with psycopg.connect(db_url) as conn:
        recorded = conn.execute("SELECT month FROM retention_drops ORDER BY month").fetchall()
    assert [r[0] for r in recorded] == DUE


def _export_then(damage: Any) -> Any:
    """``export_month`` that does ``damage(conn, month, path)`` to month 202501 once it is exported."""
    real = archive.export_month

    def export(conn: Any, month: str, directory: Path, **kw: Any) -> Any:
        manifest = real(conn, month, directory, **kw)
        if month == "202501":
            damage(conn, month, directory / month)
        return manifest

    return export


def test_a_corrupt_archive_stops_the_drop(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _seeded(db_url)
    real = archive.export_month

    def export(conn: Any, month: str, directory: Path, **kw: Any) -> Any:
        if month == "202501":       # the file is cut short between writing and verifying
            def truncate(p: Path) -> None:
                f = p / "task_instances.parquet"
                f.write_bytes(f.read_bytes()[:100])
            kw["before_verify"] = truncate
        return real(conn, month, directory, **kw)

    monkeypatch.setattr(retire, "export_month", export)
    assert _drop(db_url, tmp_path, "--yes") == 1
    err = capsys.readouterr().err
    assert "month 202501 was not dropped: its archive did not verify" in err and "done before it: 202412" in err
    assert {"202501", "202503"} <= _months(db_url) and "202412" not in _months(db_url)
    assert _audit(db_url) == [("partitions archive", "202412"), ("partitions drop", "202412")]
    assert not (tmp_path / "202501").exists()


def test_rows_changed_after_archiving_stop_the_drop(db_url: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    info = _seeded(db_url)

    def soft_delete(conn: Any, month: str, path: Path) -> None:
        with psycopg.connect(db_url, autocommit=True) as other:      # a run deleted after the export
            other.execute("UPDATE workflow_runs SET deleted_at = now() WHERE id = %s", (info.runs["H1"],))

    monkeypatch.setattr(retire, "export_month", _export_then(soft_delete))
    with pytest.raises(BadArchive, match="workflow_runs_p202501 changed after it was archived"):
        retire.retire_months(db_url, "2025-05-01", archive_dir=tmp_path, yes=True)
    assert {"202501", "202503"} <= _months(db_url)


def test_detach_keeps_the_months_as_tables(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    info = _seeded(db_url)
    base = ["partitions", "detach", "--older-than", "2025-05-01", "--database-url", db_url]
    with psycopg.connect(db_url) as conn:
        before = conn.execute("SELECT count(*) FROM task_instances_p202501").fetchone()
    assert main(base) == 3 and _audit(db_url) == []                    # dry run
    assert "would detach 202501" in capsys.readouterr().out
    assert main([*base, "--yes", "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert [(m["month"], m["outcome"]) for m in out["months"]] == [(m, "detached") for m in DUE]
    assert not set(DUE) & _months(db_url)
    assert _audit(db_url) == [("partitions detach", m) for m in DUE]
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM composer_detached.task_instances_p202501").fetchone() == before
        kept = conn.execute("SELECT id FROM composer_detached.workflow_runs_p202501 WHERE id = %s",
                            (info.runs["H1"],)).fetchone()
        assert kept == (info.runs["H1"],)
        fks = conn.execute("""SELECT count(*) FROM pg_constraint WHERE contype = 'f'
                               AND conrelid = 'composer_detached.task_instances_p202501'::regclass""").fetchone()
        assert fks == (0,)
        # The month can be created again (a restore, or a client run ID): no name is taken.
        partitions.ensure_from(conn, date(2025, 1, 1), 0)
        assert conn.execute("SELECT count(*) FROM workflow_runs_p202501").fetchone() == (0,)
        conn.rollback()
    assert main([*base, "--yes"]) == 3                                  # nothing left to detach
    assert "no month is due for retention" in capsys.readouterr().out
    # The month made again (restored, say) and due again: its detached copy holds the
    # names, so it is refused, dry run or not, and the copy is left as it was.
    with psycopg.connect(db_url) as conn:
        partitions.ensure_from(conn, date(2025, 1, 1), 0)
        conn.execute("""INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, input_json)
                        SELECT id, workflow_definition_id, workflow_version, status, input_json
                          FROM composer_detached.workflow_runs_p202501""")
    for argv in (base, [*base, "--yes"]):
        assert main(argv) == 1
        captured = capsys.readouterr()
        assert "month 202501 not detached: a detached copy of the month is already in composer_detached " \
               "(run_history_p202501, task_instances_p202501, " in captured.err, captured.err
        assert "refused 202501: 3 rows" in captured.out, captured.out      # the rows the month holds
    assert "202501" in _months(db_url) and _audit(db_url) == [("partitions detach", m) for m in DUE]
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM composer_detached.task_instances_p202501").fetchone() == before
        # Renamed, the copies keep their indexes' names, which the month's own would take.
        for table in ("run_history", "task_instances", "workflow_events", "workflow_runs"):
            conn.execute(f"ALTER TABLE composer_detached.{table}_p202501 RENAME TO old_{table}_p202501".encode())
    assert main(base) == 1
    assert "_p202501_pkey" in capsys.readouterr().err



def test_the_coordinators_scans_go_on_while_a_month_is_compared_with_its_archive(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop compares the month's rows with its archive while holding the month's
    partitions; the coordinator's timer and lease passes meanwhile lock each run table,
    then every month of it (the active floor's read plans them all). Were the month held
    in ACCESS EXCLUSIVE mode, the pass would wait for it while holding the table, and the
    drop then wait for the table: a deadlock, which PostgreSQL ends by aborting one of
    them ("deadlock detected" in the coordinator's timer loop)."""
    _seeded(db_url)
    comparing, go_on = threading.Event(), threading.Event()
    real = archive.content_fingerprint

    def held_while_comparing(conn: Any, partition: str) -> Any:
        comparing.set()
        go_on.wait(120)
        return real(conn, partition)

    monkeypatch.setattr(retire, "content_fingerprint", held_while_comparing)
    results: list[Any] = []
    dropping = threading.Thread(target=lambda: results.append(
        retire.retire_months(db_url, "2025-05-01", archive_dir=tmp_path, yes=True, max_attempts=1)))
    dropping.start()
    try:
        assert comparing.wait(60)
        with Engine.connect(db_url, pool_size=1) as engine:
            coordinator = engine.coordinator(floor_every_s=0)
            passes: list[Any] = []
            scanning = threading.Thread(target=lambda: passes.append(coordinator.run_once(["timers", "leases"])))
            scanning.start()
            scanning.join(30)                  # a pass takes milliseconds unless it waits for the month
            finished_while_held = not scanning.is_alive()
            go_on.set()
            scanning.join(60)
    finally:
        go_on.set()
        dropping.join(120)
    assert finished_while_held, "the coordinator's pass waited for the month being compared"
    assert passes and passes[0].errors == []
    assert [(m.month, m.outcome) for m in results[0].months] == [(m, "dropped") for m in DUE]


@pytest.mark.parametrize("given", ["--archive ''", "--archive ' '", "COMPOSER_ARCHIVE_DIR=''"])
def test_an_empty_archive_directory_is_refused_before_anything(
        db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], given: str) -> None:
    """``--archive "$DIR"`` with DIR unset must not become a drop without an archive."""
    _seeded(db_url)
    before = _months(db_url)
    if given.startswith("COMPOSER_ARCHIVE_DIR"):
        monkeypatch.setenv("COMPOSER_ARCHIVE_DIR", "")
        extra = []
    else:
        extra = ["--archive", given.split(" ", 1)[1].strip("'")]
    for yes in ([], ["--yes"]):
        assert main(["partitions", "drop", "--older-than", "2025-05-01", *extra, "--database-url", db_url,
                     *yes]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and "the archive directory is empty" in err[0], err
        assert captured.out == ""
    assert _months(db_url) == before and _audit(db_url) == []


def test_a_tilde_archive_directory_is_the_home_directory(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--archive ~/arch`` (and COMPOSER_ARCHIVE_DIR) is under $HOME, as ``restore --from ~/arch`` reads it,
    never a directory named ``~`` in the working directory."""
    _seeded(db_url)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["partitions", "archive", "--older-than", "2025-02-01", "--to", "~/a", "--database-url",
                 db_url]) == 0
    monkeypatch.setenv("COMPOSER_ARCHIVE_DIR", "~/b")
    assert _drop_env(db_url, "--yes") == 3
    capsys.readouterr()
    assert not (tmp_path / "~").exists()
    assert archive.verify_month(tmp_path / "home" / "a" / "202412").month == "202412"
    assert all(archive.verify_month(tmp_path / "home" / "b" / m).month == m for m in DUE)
    assert main(["partitions", "restore", "202412", "--from", "~/b", "--database-url", db_url, "--yes"]) == 0


def _drop_env(db_url: str, *extra: str) -> int:
    return main(["partitions", "drop", "--older-than", "2025-05-01", "--database-url", db_url, *extra])


def test_detach_says_its_rows_are_an_estimate(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Detach reports the plan's catalog estimate (counting would scan each month under the
    locks that stop every writer): its line and its audit row say so, as they would
    after the statistics were reset and the estimate fell to 0."""
    _seeded(db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ANALYZE")
        exact = conn.execute("SELECT count(*) FROM task_instances_p202501").fetchone()
        conn.execute("SELECT pg_stat_reset_single_table_counters('task_instances_p202501'::regclass)")
    assert main(["partitions", "detach", "--older-than", "2025-05-01", "--database-url", db_url]) == 3
    out = capsys.readouterr().out
    assert "would detach 202501: about " in out, out          # the dry run says so too
    assert main(["partitions", "detach", "--older-than", "2025-05-01", "--database-url", db_url, "--yes"]) == 3
    out = capsys.readouterr().out
    assert "detached 202501: about " in out, out
    with psycopg.connect(db_url) as conn:
        counts = conn.execute("""SELECT counts FROM operator_audit
                                  WHERE action = 'partitions detach' AND target = '202501'""").fetchone()
        assert exact == conn.execute("SELECT count(*) FROM composer_detached.task_instances_p202501").fetchone()
    assert counts is not None and "rows" not in counts[0] and counts[0]["rows_estimated"] >= 0, counts
    assert main(["audit", "list", "--database-url", db_url, "--action", "partitions detach"]) == 0
    assert "rows_estimated" in capsys.readouterr().out


def test_a_detach_that_gives_up_names_the_session_holding_the_lock(db_url: str) -> None:
    _seeded(db_url)
    with psycopg.connect(db_url, application_name="long-report") as holder:
        holder.execute("SELECT count(*) FROM task_instances_p202412")
        pid = holder.info.backend_pid
        with pytest.raises(ComposerError) as raised:
            retire.retire_months(db_url, "2025-05-01", keep_table=True, yes=True, lock_timeout_s=0.1,
                                 max_attempts=1)
        holder.rollback()
    assert "month 202412: could not lock its partitions" in str(raised.value)
    assert f"locks held by pid {pid} (" in str(raised.value) and "long-report" in str(raised.value)
    assert "202412" in _months(db_url)
