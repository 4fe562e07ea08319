"""Partition archives: archive what retention would drop, drop it, restore it, and get
back identical rows (hypothesis over months, statuses and odd values, under session
time zones other than UTC); a corrupt or partial archive is refused; dry runs write
nothing; every action writes its audit row."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from composer_ops.cli import main
from composer_ops.core.manifest import BadArchive
from composer_ops.engine import archive
from composer_ops.errors import ComposerError
from composer_ops.repo import partitions
from composer_ops.testing import fixtures
from composer_ops.testing.processes import wait_for
from tests.integration.helpers import drop_months, seed_aligned

MONTHS = [f"{y}{m:02d}" for y in (2024, 2025) for m in range(1, 13)]
TERMINAL = ["SUCCEEDED", "FAILED", "CANCELLED"]
STATUSES = [*TERMINAL, "RUNNING", "PENDING"]
TASK_STATES = ["COMPLETED", "FAILED", "SKIPPED", "CANCELLED", "PENDING", "RUNNING", "WAITING"]
ZONES = ["UTC", "America/New_York", "Asia/Tokyo", "Pacific/Chatham", "America/St_Johns"]

text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8)
instants = st.datetimes(min_value=datetime(2023, 1, 1), max_value=datetime(2027, 1, 1), timezones=st.just(UTC))
tasks_st = st.lists(st.tuples(st.sampled_from(TASK_STATES), json_values, st.one_of(st.none(), text),
                              st.one_of(st.none(), st.lists(st.one_of(st.none(), text), max_size=3)),
                              st.one_of(st.none(), instants), st.integers(0, 5)), max_size=3)
runs_st = st.lists(st.tuples(st.sampled_from(STATUSES), st.integers(1, 28), json_values, tasks_st,
                             st.lists(st.tuples(text, json_values, st.booleans()), max_size=2), st.booleans()),
                   min_size=1, max_size=3)
layouts = st.dictionaries(st.sampled_from(MONTHS), runs_st, min_size=1, max_size=3)

DUMP_TABLES = partitions.RUN_TABLES


def _populate(conn: psycopg.Connection[Any], layout: dict[str, Any]) -> None:
    seq = 0
    for month, runs in layout.items():
        conn.execute("SELECT composer_ensure_partitions_from(%s, 0)", (date(int(month[:4]), int(month[4:]), 1),))
        for status, day, payload, tasks, events, deleted in runs:
            at = datetime(int(month[:4]), int(month[4:]), day, 13, 7, 11, 123456, tzinfo=UTC)
            seq += 1
            run_id = fixtures.uuid7_text(at, seq)
            conn.execute("""
                INSERT INTO workflow_runs (id, workflow_definition_id, workflow_version, status, input_json,
                                           context_json, error_json, output_json, deleted_at, created_at,
                                           updated_at, completed_at)
                VALUES (%s, 'wf', 1, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
                (run_id, status, Jsonb(payload), Jsonb({"input": payload, "config": {"k": "é"}}),
                 Jsonb({"error": "bad\ttab"}) if status == "FAILED" else None, Jsonb([payload]),
                 at + timedelta(days=1) if deleted else None, at, at + timedelta(seconds=1.5),
                 at + timedelta(microseconds=7) if status in TERMINAL else None))
            for i, (state, output, error, branches, wake_at, attempt) in enumerate(tasks):
                seq += 1
                conn.execute("""
                    INSERT INTO task_instances (id, run_id, node_id, node_type, queue, state, attempt, input_json,
                                                output_json, last_error, branches, wake_at, signal_name,
                                                created_at, updated_at, lease_owner, lease_expires_at)
                    VALUES (%s, %s, %s, 'TASK', 'q', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
                    (fixtures.uuid7_text(at, seq), run_id, f"n{i}", state, attempt, Jsonb({"i": i}), Jsonb(output),
                     Jsonb({"error": error}) if error is not None else None, branches, wake_at, error, at, at,
                     "host:1:ab" if state == "RUNNING" else None, wake_at if state == "RUNNING" else None))
            for name, body, consumed in events:
                seq += 1
                conn.execute("INSERT INTO workflow_events (id, run_id, name, payload, created_at, consumed_at) "
                             "VALUES (%s, %s, %s, %s, %s, %s)",
                             (fixtures.uuid7_text(at, seq), run_id, name or "e", Jsonb(body), at,
                              at + timedelta(hours=1) if consumed else None))
            # The run's history: its start, then a claim per task with the task's odd values as detail.
            history = [("started", None, None, None, None, Jsonb(payload))] + [
                ("claimed", f"n{i}", fixtures.uuid7_text(at, seq), attempt, error, Jsonb(output))
                for i, (_state, output, error, _b, _w, attempt) in enumerate(tasks)]
            for kind, node, task, attempt, worker, detail in history:
                conn.execute("INSERT INTO run_history (run_id, at, kind, node_id, task_id, attempt, worker, request, "
                             "detail) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                             (run_id, at + timedelta(microseconds=3), kind, node, task, attempt, worker,
                              f"req-{seq}", detail))


def _dump(url: str, month: str) -> dict[str, list[str]]:
    """Every row of the month, as text, in a UTC session."""
    with psycopg.connect(url) as conn:
        conn.execute("SET TimeZone = 'UTC'")
        return {t: [r[0] for r in conn.execute(f"SELECT x::text FROM {t}_p{month} x ORDER BY 1".encode())]
                for t in DUMP_TABLES}


def _droppable(runs: list[Any]) -> bool:
    return all(status in TERMINAL for status, *_ in runs)


def _audit(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT action, target, counts, command, client_host, client_addr, login_role, db_role "
                            "FROM operator_audit ORDER BY id").fetchall()


# 12 archive-drop-restore rounds: on Citus at load average 25, more than the default 120 s.
@pytest.mark.timeout(600)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(layout=layouts, archive_tz=st.sampled_from(ZONES), restore_tz=st.sampled_from(ZONES))
def test_archive_drop_restore_gives_back_identical_rows(db_url: str, tmp_path_factory: pytest.TempPathFactory,
                                                       monkeypatch: pytest.MonkeyPatch, layout: dict[str, Any],
                                                       archive_tz: str, restore_tz: str) -> None:
    directory = tmp_path_factory.mktemp("archive")
    with psycopg.connect(db_url) as conn:
        conn.execute("""INSERT INTO workflow_definitions (id, name, version, spec_json, created_by)
                        VALUES ('wf', 'wf', 1, '{}', 'test') ON CONFLICT DO NOTHING""")
        _populate(conn, layout)
    due = sorted(m for m, runs in layout.items() if _droppable(runs))
    before = {m: _dump(db_url, m) for m in layout}
    assert all(before[m]["run_history"] for m in layout)          # every run table of the month has rows
    cutoff = datetime(2026, 1, 1, tzinfo=UTC)
    try:
        monkeypatch.setenv("PGTZ", archive_tz)
        result = archive.archive_due(db_url, cutoff, directory)
        assert [m.month for m in result.months] == due
        assert sorted(m for m, _ in result.kept if m in layout) == sorted(set(layout) - set(due))
        with psycopg.connect(db_url, autocommit=True) as conn:
            assert drop_months(conn, cutoff) == due
        monkeypatch.setenv("PGTZ", restore_tz)
        for month in due:
            restored = archive.restore_month(db_url, month, directory, yes=True)
            assert all(t.fingerprint_matches for t in restored.tables)
        after = {m: _dump(db_url, m) for m in layout}
        assert after == before
        assert [(a, t) for a, t, *_ in _audit(db_url)][-2 * len(due):] == (
            [("partitions archive", m) for m in due] + [("partitions restore", m) for m in due])
    finally:
        monkeypatch.setenv("PGTZ", "America/New_York")
        with psycopg.connect(db_url, autocommit=True) as conn:   # leave no month for the next example
            conn.execute("UPDATE workflow_runs SET status = 'SUCCEEDED'")
            drop_months(conn, cutoff)
            conn.execute("DELETE FROM operator_audit")
        shutil.rmtree(directory, ignore_errors=True)


def _seeded(db_url: str) -> fixtures.SeedInfo:
    with psycopg.connect(db_url) as conn:
        info = seed_aligned(conn)
        conn.commit()
    return info


def test_archive_cli_dry_run_writes_nothing_then_archives_with_audit_rows(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _seeded(db_url)
    target = tmp_path / "arch"
    args = ["partitions", "archive", "--older-than", "2025-05-01", "--to", str(target), "--database-url", db_url]
    assert main([*args, "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(m["month"], m["archived"]) for m in out["months"]] == [("202412", False), ("202501", False),
                                                                    ("202503", False)]
    assert {"month": "202502", "reason": "has active runs"} in out["kept"]
    assert not target.exists() and _audit(db_url) == []
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(m["month"], m["archived"]) for m in out["months"]] == [("202412", True), ("202501", True),
                                                                    ("202503", True)]
    assert sorted(p.name for p in (target / "202501").iterdir()) == sorted(
        ["manifest.json", *(f"{t}.parquet" for t in partitions.RUN_TABLES)])
    assert not [p for p in target.iterdir() if p.name.startswith(".")]     # no partial directory left
    manifest = archive.verify_month(target / "202501")
    assert (manifest.month, manifest.table("workflow_runs").rows, manifest.table("task_instances").rows) == (  # type: ignore[union-attr]
        "202501", 3, 9)
    rows = _audit(db_url)
    assert [(a, t, c["rows"]) for a, t, c, *_ in rows] == [("partitions archive", "202412", 0),
                                                           ("partitions archive", "202501", 12),
                                                           ("partitions archive", "202503", 18)]
    _, _, _, command, host, addr, login, role = rows[1]
    assert command.startswith("composer-ops partitions archive --older-than 2025-05-01") and host
    assert (addr, login, role) == ("local", "postgres", "postgres")
    # The months are still there: archiving changes no data.
    with psycopg.connect(db_url) as conn:
        assert {p.month for p in partitions.list_partitions(conn)} >= {"202501", "202503"}
    assert main([*args[:-2], "--to", "/proc/no-such-dir/x", "--database-url", db_url]) == 2
    assert "cannot write there" in capsys.readouterr().err


def _corruptions() -> dict[str, Any]:
    def truncate(p: Path) -> None:
        f = p / "task_instances.parquet"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    def flip(p: Path) -> None:
        f = p / "workflow_runs.parquet"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))

    def missing(p: Path) -> None:
        (p / "workflow_events.parquet").unlink()

    def no_manifest(p: Path) -> None:
        (p / "manifest.json").unlink()

    def wrong_rows(p: Path) -> None:
        doc = json.loads((p / "manifest.json").read_text())
        doc["tables"][0]["rows"] += 1
        (p / "manifest.json").write_text(json.dumps(doc))

    def rewritten(p: Path) -> None:   # a valid Parquet file with other rows, its SHA-256 updated to match
        import pyarrow.parquet as pq

        f = p / "workflow_runs.parquet"
        table = pq.read_table(f)
        pq.write_table(table.slice(0, table.num_rows - 1), f)
        doc = json.loads((p / "manifest.json").read_text())
        doc["tables"][0]["sha256"] = archive._file_sha256(f)
        (p / "manifest.json").write_text(json.dumps(doc))

    return {"truncated": truncate, "flipped byte": flip, "missing file": missing, "no manifest": no_manifest,
            "wrong row count": wrong_rows, "rows changed, checksum updated": rewritten}


@pytest.mark.parametrize("corrupt", list(_corruptions()))
def test_a_corrupt_or_partial_archive_is_refused(db_url: str, tmp_path: Path, corrupt: str) -> None:
    _seeded(db_url)
    damage = _corruptions()[corrupt]
    # Damaged while being written: the export fails, nothing is moved into place, no audit row.
    with psycopg.connect(db_url) as conn, pytest.raises(BadArchive):
        archive.export_month(conn, "202501", tmp_path, before_verify=damage,
                             on_exported=lambda *_: pytest.fail("a bad archive was accepted"))
    assert list(tmp_path.iterdir()) == [] and _audit(db_url) == []
    # Damaged afterwards: verification and restore refuse it before touching the database.
    with psycopg.connect(db_url) as conn:
        archive.export_month(conn, "202501", tmp_path)
    damage(tmp_path / "202501")
    with pytest.raises(BadArchive):
        archive.verify_month(tmp_path / "202501")
    with pytest.raises(BadArchive):
        archive.restore_month(db_url, "202501", tmp_path, yes=True)
    assert _audit(db_url) == []


def test_restore_dry_run_writes_nothing_and_a_month_with_rows_is_refused(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _seeded(db_url)
    with psycopg.connect(db_url) as conn:
        archive.export_month(conn, "202501", tmp_path)
    before = _dump(db_url, "202501")
    base = ["partitions", "restore", "202501", "--from", str(tmp_path), "--database-url", db_url]
    assert main(base) == 1                                      # the month still holds its rows
    assert "already holds 3 rows" in capsys.readouterr().err
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert drop_months(conn, datetime(2025, 2, 1, tzinfo=UTC)) == ["202412", "202501"]
        audit_before = conn.execute("SELECT count(*) FROM operator_audit").fetchone()
    assert main([*base, "--json"]) == 0                         # dry run: verified, nothing written
    out = json.loads(capsys.readouterr().out)
    assert (out["restored"], out["rows"]) == (False, 12)
    with psycopg.connect(db_url) as conn:
        assert "202501" not in {p.month for p in partitions.list_partitions(conn)}
        assert conn.execute("SELECT count(*) FROM operator_audit").fetchone() == audit_before
    assert main([*base, "--yes"]) == 0
    assert "restored month 202501" in capsys.readouterr().out
    assert _dump(db_url, "202501") == before
    assert [(a, t, c["rows"]) for a, t, c, *_ in _audit(db_url)] == [("partitions restore", "202501", 12)]
    assert main([*base, "--yes"]) == 1                          # a second restore finds the rows there
    assert main(["partitions", "restore", "2025-01", "--from", str(tmp_path), "--database-url", db_url]) == 2
    capsys.readouterr()
    assert main(["partitions", "restore", "202501", "--from", str(tmp_path / "nowhere"), "--database-url",
                 db_url]) == 2
    assert f"--from {tmp_path / 'nowhere'}: no such directory" in capsys.readouterr().err
    with pytest.raises(ComposerError):
        archive.restore_month(db_url, "202503", tmp_path, yes=False)   # no archive of that month


def test_a_restore_of_runs_whose_definition_is_gone_is_refused_and_writes_nothing(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the runs' foreign key to their definition refused row by row until V019: a
    definition version deleted by hand since the month was archived."""
    _seeded(db_url)
    with psycopg.connect(db_url) as conn:
        archive.export_month(conn, "202501", tmp_path)
        named = conn.execute("SELECT DISTINCT workflow_definition_id, workflow_version FROM workflow_runs_p202501"
                             " ORDER BY 1, 2").fetchall()
    assert named
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert drop_months(conn, datetime(2025, 2, 1, tzinfo=UTC)) == ["202412", "202501"]
        wf, version = named[0]
        conn.execute("DELETE FROM workflow_definitions WHERE id = %s AND version = %s", (wf, version))
    args = ["partitions", "restore", "202501", "--from", str(tmp_path), "--database-url", db_url]
    for yes in ([], ["--yes"]):                          # the dry run says so too
        assert main([*args, *yes]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{wf!r} v{version}" in err[0] and "rows back" in err[0], err
    with psycopg.connect(db_url) as conn:                 # not even the month's empty partitions
        assert "202501" not in {p.month for p in partitions.list_partitions(conn)}
    assert _audit(db_url) == []


def test_a_run_table_without_the_months_partition_is_archived_empty(db_url: str, tmp_path: Path) -> None:
    _seeded(db_url)
    with psycopg.connect(db_url) as conn:
        conn.execute("DROP TABLE workflow_events_p202501")
        conn.commit()
        manifest = archive.export_month(conn, "202501", tmp_path)
    events = manifest.table("workflow_events")
    assert events is not None and (events.rows, events.fingerprint) == (0, "0") and events.columns
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert "202501" in drop_months(conn, datetime(2025, 2, 1, tzinfo=UTC))
    restored = archive.restore_month(db_url, "202501", tmp_path, yes=True)
    assert [(t.table, t.rows) for t in restored.tables][:3] == [("workflow_runs", 3), ("task_instances", 9),
                                                               ("workflow_events", 0)]


def test_archive_as_the_read_only_role_is_refused_before_anything_is_written(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.notebooks.harness import as_role

    _seeded(db_url)
    target = tmp_path / "arch"
    reader = as_role(db_url)
    args = ["partitions", "archive", "--older-than", "2025-05-01", "--to", str(target), "--database-url", reader]
    assert main([*args, "--dry-run"]) == 0             # the reader may look at the plan
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "role composer_ops_reader is not the schema's owner" in err[0], err
    assert not target.exists() and _audit(db_url) == []


def test_an_archive_written_before_v006_restores_its_signal_names(db_url: str, tmp_path: Path) -> None:
    """An archive of 0.1.0 holds task_instances' column by its old name; it restores
    into signal_name (core.manifest.RENAMED_COLUMNS)."""
    import pyarrow.parquet as pq

    from composer_ops.core.manifest import MANIFEST, read_manifest

    old_column = "event_name"   # the old spelling, as 0.1.0 archived it
    _seeded(db_url)
    with psycopg.connect(db_url) as conn:
        before = conn.execute("SELECT id, signal_name FROM task_instances_p202503 ORDER BY id").fetchall()
        conn.rollback()
        archive.export_month(conn, "202503", tmp_path)
    assert any(name for _, name in before)
    folder = tmp_path / "202503"
    manifest = json.loads((folder / MANIFEST).read_text())
    entry = next(t for t in manifest["tables"] if t["table"] == "task_instances")
    file = folder / entry["file"]
    table = pq.read_table(file)
    pq.write_table(table.rename_columns([old_column if n == "signal_name" else n for n in table.column_names]), file)
    entry["columns"] = [{**c, "name": old_column if c["name"] == "signal_name" else c["name"]}
                        for c in entry["columns"]]
    entry["sha256"] = hashlib.sha256(file.read_bytes()).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert old_column in [c["name"] for c in read_manifest(folder).table("task_instances").columns]  # type: ignore[union-attr]
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert "202503" in drop_months(conn, datetime(2025, 4, 1, tzinfo=UTC))
    restored = archive.restore_month(db_url, "202503", tmp_path, yes=True)
    assert all(t.fingerprint_matches for t in restored.tables)
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT id, signal_name FROM task_instances_p202503 ORDER BY id").fetchall() == before


def _rows_archived(path: Path) -> dict[str, int]:
    return {t.table: t.rows for t in archive.verify_month(path).tables}


def test_a_failed_restore_leaves_no_partitions_and_its_archive_is_never_emptied(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A restore whose copy fails (here its lock wait on the audit table) drops the month's
    partitions it created; and were empty partitions left there, `drop --archive` into the
    same directory refuses the month rather than replace its only copy with an empty one."""
    _seeded(db_url)
    target = tmp_path / "arch"
    drop = ["partitions", "drop", "--older-than", "2025-02-01", "--archive", str(target), "--database-url", db_url,
            "--yes"]
    assert main(drop) == 0
    archived = _rows_archived(target / "202501")
    assert archived["workflow_runs"] == 3
    restore = ["partitions", "restore", "202501", "--from", str(target), "--database-url", db_url, "--yes",
               "--lock-timeout", "0.1"]
    with psycopg.connect(db_url) as holder:
        holder.execute("LOCK TABLE operator_audit IN ACCESS EXCLUSIVE MODE")
        assert main(restore) == 1
        holder.rollback()
    assert "lock" in capsys.readouterr().err
    with psycopg.connect(db_url) as conn:
        assert "202501" not in {p.month for p in partitions.list_partitions(conn)}
    # The month's partitions empty anyway (a restore that could not drop them again):
    # the archive in place holds more rows, so the month is refused and the others go on.
    with psycopg.connect(db_url) as conn:
        partitions.ensure_from(conn, date(2025, 1, 1), 0)
        conn.commit()
    assert main([*drop[:3], "2025-03-01", *drop[4:]]) == 1
    captured = capsys.readouterr()
    assert "refused 202501: 0 rows" in captured.out and "kept 202502: has active runs" in captured.out
    assert captured.err.strip().splitlines() == [
        f"composer-ops: month 202501 not dropped: {target / '202501'}: the archive in place holds 3 rows of "
        "workflow_runs, the month now 0: an archive is never replaced by one with fewer rows (restore the month "
        "from it, or archive into another directory)"]
    assert _rows_archived(target / "202501") == archived
    assert main(["partitions", "archive", "--older-than", "2025-02-01", "--to", str(target), "--database-url",
                 db_url]) == 1
    captured = capsys.readouterr()
    assert "refused 202501: " in captured.out and "holds 3 rows of workflow_runs, the month now 0" in captured.err
    assert _rows_archived(target / "202501") == archived
    assert main(restore) == 0                     # the empty partitions are filled from the archive kept
    capsys.readouterr()
    # The same rows archived again (a drop --archive run again after an interruption) replace it.
    assert main(["partitions", "archive", "--older-than", "2025-02-01", "--to", str(target), "--database-url",
                 db_url]) == 0
    assert main(drop) == 0
    assert _rows_archived(target / "202501") == archived


def test_a_month_the_archive_directory_does_not_hold_is_bad_input(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _seeded(db_url)
    with psycopg.connect(db_url) as conn:
        archive.export_month(conn, "202501", tmp_path)
    capsys.readouterr()
    restore = ["partitions", "restore", "202503", "--from", str(tmp_path), "--database-url", db_url]
    assert main(restore) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no archive of month 202503 under {tmp_path}" in err, err
    assert "it holds 202501" in err, err
    (tmp_path / "202503").mkdir()                  # there, but partial: a damaged archive, exit 1
    assert main(restore) == 1
    assert "no manifest.json" in capsys.readouterr().err
    assert _audit(db_url) == []


# A child process that archives one month and is SIGKILLed at a chosen point: "write"
# once every file of the month is written in its hidden work directory, before it is
# verified; "move" between the two renames that replace an archive in place.
_KILLED_ARCHIVE = """
import os, sys, time
from pathlib import Path
import psycopg
from composer_ops.engine import archive

url, month, directory, ready, point = sys.argv[1:]

def pause(*_):
    Path(ready).write_text(str(os.getpid()))
    time.sleep(120)

hook = None
if point == "write":
    hook = pause
else:
    replace = os.replace
    def paused(src, dst):
        replace(src, dst)
        if Path(src).name == month:      # the archive in place moved aside; its successor not yet moved in
            pause()
    archive.os.replace = paused
with psycopg.connect(url) as conn:
    archive.export_month(conn, month, Path(directory), before_verify=hook)
"""


def _archive_killed(db_url: str, directory: Path, month: str, point: str, tmp_path: Path) -> None:
    """Run :data:`_KILLED_ARCHIVE` and SIGKILL it at ``point``."""
    ready = tmp_path / f"ready-{month}-{point}"
    ready.unlink(missing_ok=True)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_ARCHIVE, db_url, month, str(directory), str(ready),
                              point], env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        wait_for(lambda: ready.exists() or child.poll() is not None, timeout=120, what="the archive to pause")
        assert child.poll() is None, f"the archiving child exited with {child.returncode} before its kill"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(30)
    assert child.returncode == -signal.SIGKILL


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_an_archive_killed_while_writing_leaves_nothing_taken_for_an_archive(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _seeded(db_url)
    target = tmp_path / "arch"
    _archive_killed(db_url, target, "202501", "write", tmp_path)
    (partial,) = _hidden(target)
    assert partial.startswith(".202501.partial-")
    assert sorted(p.name for p in (target / partial).iterdir()) == sorted(
        ["manifest.json", *(f"{t}.parquet" for t in partitions.RUN_TABLES)])    # complete, but never verified
    assert not (target / "202501").exists()
    capsys.readouterr()
    # Restore does not take it for an archive: the month is not there (bad input), and
    # the directory, it says, holds no month's archive.
    restore = ["partitions", "restore", "202501", "--from", str(target), "--database-url", db_url]
    assert main(restore) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no archive of month 202501" in err and "it holds no month's archive" in err
    # The next archive of the month writes it afresh and removes what the killed one left.
    args = ["partitions", "archive", "--older-than", "2025-05-01", "--to", str(target), "--database-url", db_url]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(m["month"], m["archived"]) for m in out["months"]] == [("202412", True), ("202501", True),
                                                                    ("202503", True)]
    assert _hidden(target) == []
    assert archive.verify_month(target / "202501").rows == 12
    # A kill while `drop --archive` writes leaves the same; its next run drops the months
    # and leaves nothing hidden either, and the month restores from its archive.
    _archive_killed(db_url, target, "202503", "write", tmp_path)
    assert [h.split("-")[0] for h in _hidden(target)] == [".202503.partial"]
    drop = ["partitions", "drop", "--older-than", "2025-05-01", "--archive", str(target), "--yes",
            "--database-url", db_url]
    assert main(drop) == 3, capsys.readouterr().err          # 3: 202502 and 202504 kept for their active runs
    assert "dropped" in capsys.readouterr().out
    assert _hidden(target) == []
    assert main([*restore, "--yes"]) == 0, capsys.readouterr().err
    assert "restored month 202501" in capsys.readouterr().out


def test_an_archive_killed_while_replacing_one_in_place_loses_nothing(
        db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _seeded(db_url)
    target = tmp_path / "arch"
    with psycopg.connect(db_url) as conn:
        first = archive.export_month(conn, "202501", target)
    _archive_killed(db_url, target, "202501", "move", tmp_path)
    # Killed between the renames: the verified archive moved aside, its successor not in place.
    assert not (target / "202501").exists()
    assert sorted(h.split("-")[0] for h in _hidden(target)) == [".202501.old", ".202501.partial"]
    capsys.readouterr()
    restore = ["partitions", "restore", "202501", "--from", str(target), "--database-url", db_url]
    assert main(restore) == 2                     # not in place, and restore reads nothing hidden: it says where
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no archive of month 202501" in err and "/.202501.old-" in err, err
    assert "a killed archive run was replacing" in err
    # The month now holds fewer runs than the archive that was being replaced: the next
    # archive of it must find that archive and keep it, never write the smaller one over it.
    with psycopg.connect(db_url) as conn:
        conn.execute("DELETE FROM workflow_runs WHERE id = (SELECT min(id) FROM workflow_runs_p202501)")
    capsys.readouterr()
    args = ["partitions", "archive", "--older-than", "2025-05-01", "--to", str(target), "--database-url", db_url]
    assert main([*args, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    (month,) = [m for m in out["months"] if m["month"] == "202501"]
    assert not month["archived"] and "an archive is never replaced by one with fewer rows" in month["refused"]
    assert archive.verify_month(target / "202501") == first
    assert _hidden(target) == []


def test_an_archive_is_on_disk_before_it_is_moved_into_place(db_url: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A drop with --archive relies on the archive once it verifies, and verifying reads
    the page cache: every file and its directory are flushed (fsync) before the archive
    takes its place, and the archive directory after the rename."""
    _seeded(db_url)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    moves: list[int] = []
    real_move = archive._move_into_place

    def move(work: Path, target: Path) -> None:
        moves.append(len(synced))
        real_move(work, target)
    monkeypatch.setattr(archive, "_move_into_place", move)
    with psycopg.connect(db_url) as conn:
        archive.export_month(conn, "202501", tmp_path)
    (before,) = moves
    done = tmp_path / "202501"
    work = Path(synced[before - 1])
    assert work.name.startswith(".202501.partial-"), synced
    files = {work / p.name for p in done.iterdir()}
    assert files and files <= {Path(s) for s in synced[:before]}, (files, synced)
    assert synced[before:] == [str(tmp_path)], synced
