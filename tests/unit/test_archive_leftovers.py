"""What a killed archive run leaves in the archive directory, and how the next export of
the month tidies it (engine/archive.py ``_tidy``): a work directory a live export holds
is never touched; an abandoned one is removed; an archive moved aside is put back when
nothing is in place."""

from __future__ import annotations

import os
from pathlib import Path

from composer_ops.core.manifest import read_manifest
from composer_ops.engine import archive


def _archive_dir(path: Path, created_at: str) -> Path:
    path.mkdir()
    (path / "manifest.json").write_text(
        '{"format": "composer-archive/1", "month": "202501", "lower_bound": "", "upper_bound": "", '
        f'"created_at": "{created_at}", "schema_version": 1, "tables": []}}', encoding="utf-8")
    return path


def test_a_live_export_keeps_its_work_directory_and_an_abandoned_one_is_removed(tmp_path: Path) -> None:
    live = tmp_path / ".202501.partial-live"
    dead = tmp_path / ".202501.partial-dead"
    other = tmp_path / ".202502.partial-dead"
    for d in (live, dead, other):
        d.mkdir()
        (d / "workflow_runs.parquet").write_bytes(b"PAR1")
    held = archive._hold(live)
    try:
        with archive._locked(tmp_path):
            archive._tidy(tmp_path, "202501")
        assert sorted(p.name for p in tmp_path.iterdir()) == [".202501.partial-live", ".202502.partial-dead"]
    finally:
        os.close(held)
    with archive._locked(tmp_path):
        archive._tidy(tmp_path, "202501")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".202502.partial-dead"]   # another month's: its own run


def test_an_archive_moved_aside_is_put_back_when_none_is_in_place(tmp_path: Path) -> None:
    _archive_dir(tmp_path / ".202501.old-aaaa", "2026-01-01T00:00:00Z")
    _archive_dir(tmp_path / ".202501.old-bbbb", "2026-02-01T00:00:00Z")
    with archive._locked(tmp_path):
        archive._tidy(tmp_path, "202501")
    assert [p.name for p in tmp_path.iterdir()] == ["202501"]
    assert read_manifest(tmp_path / "202501").created_at == "2026-02-01T00:00:00Z"   # the newer one
    _archive_dir(tmp_path / ".202501.old-cccc", "2025-12-01T00:00:00Z")        # replaced, not yet removed
    with archive._locked(tmp_path):
        archive._tidy(tmp_path, "202501")
    assert [p.name for p in tmp_path.iterdir()] == ["202501"]
    assert read_manifest(tmp_path / "202501").created_at == "2026-02-01T00:00:00Z"


def test_a_link_left_aside_is_removed_and_what_it_points_to_is_kept(tmp_path: Path) -> None:
    """A link planted in the month's place was moved aside by the archive that replaced it;
    the next archive of the month removes the link, not its target (it failed on it)."""
    elsewhere = _archive_dir(tmp_path / "elsewhere", "2025-01-01T00:00:00Z")
    archives = tmp_path / "archives"
    archives.mkdir()
    _archive_dir(archives / "202501", "2025-03-01T00:00:00Z")
    (archives / ".202501.old-1a2b3c4d").symlink_to(elsewhere)
    archive._tidy(archives, "202501")
    assert not (archives / ".202501.old-1a2b3c4d").exists() and not (archives / ".202501.old-1a2b3c4d").is_symlink()
    assert (elsewhere / "manifest.json").exists() and (archives / "202501" / "manifest.json").exists()


def test_a_manifest_naming_a_file_outside_its_directory_is_refused(tmp_path: Path) -> None:
    import pytest

    from composer_ops.core.manifest import BadArchive

    month = tmp_path / "202501"
    month.mkdir()
    (month / "manifest.json").write_text(
        '{"format": "composer-archive/1", "month": "202501", "lower_bound": "", "upper_bound": "", '
        '"created_at": "x", "schema_version": 1, "tables": [{"table": "workflow_runs", "partition": "p", '
        '"file": "../../etc/x.parquet", "rows": 1, "sha256": "", "content_sha256": "", "fingerprint": "", '
        '"columns": []}]}', encoding="utf-8")
    with pytest.raises(BadArchive, match=r"names the file '\.\./\.\./etc/x\.parquet', which is not a file name"):
        read_manifest(month)
