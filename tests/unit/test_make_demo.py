"""`make demo` on a database of the user's own: it writes runs and schedules, retries
failed runs and drops months there, so with ``COMPOSER_DATABASE_URL`` set it does
nothing unless told ``DEMO_ON_URL=yes``; without a URL it starts the embedded server."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _make_demo(tmp_path: Path, url: str | None, *extra: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``make demo`` with stand-ins for composer-ops and python that record their arguments."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("composer-ops", "python"):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\necho "$(basename "$0") $*" >> {log}\n')
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k not in ("COMPOSER_DATABASE_URL", "MAKEFLAGS")}
    if url:
        env["COMPOSER_DATABASE_URL"] = url
    env["COMPOSER_REPORTS_DIR"] = str(tmp_path)
    stamp = tmp_path / "installed"      # newer than everything the venv stamp depends on: nothing to install
    stamp.touch()
    done = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "demo", f"BIN={bin_dir}",
                           f"STAMP={stamp}", *extra], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    return done, log.read_text(encoding="utf-8").splitlines() if log.exists() else []


def test_a_demo_on_a_database_of_ones_own_needs_saying_so(tmp_path: Path) -> None:
    done, calls = _make_demo(tmp_path, "postgresql://app@prod-db/orders")
    assert done.returncode == 2 and calls == [], (done.stdout, done.stderr, calls)
    assert "drops its months older than 5 months" in done.stderr and "DEMO_ON_URL=yes" in done.stderr
    assert "nothing was done" in done.stderr


def test_said_so_it_runs_there_without_the_embedded_server(tmp_path: Path) -> None:
    done, calls = _make_demo(tmp_path, "postgresql://app@scratch-db/demo", "DEMO_ON_URL=yes")
    assert done.returncode == 0, done.stderr
    assert calls[0] == "composer-ops migrate" and not any("db up" in c for c in calls)
    assert any(c.startswith("composer-ops partitions drop") for c in calls)


def test_without_a_url_it_starts_the_embedded_server_first(tmp_path: Path) -> None:
    done, calls = _make_demo(tmp_path, None)
    assert done.returncode == 0, done.stderr
    assert calls[:2] == ["composer-ops db up", "composer-ops migrate"]
