"""`make lab`: opens for a read-only role (nothing migrated when a URL is given), and every
save through JupyterLab writes the notebook without outputs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import nbformat
from jupyter_server.services.contents.filemanager import FileContentsManager

from tests.notebooks.harness import ROOT


def test_a_save_through_jupyter_writes_no_outputs(tmp_path: Path) -> None:
    manager = FileContentsManager(root_dir=str(tmp_path), pre_save_hook="composer_ops.ops.lab.strip_outputs")
    nb = nbformat.v4.new_notebook()  # type: ignore[no-untyped-call]
    cell = nbformat.v4.new_code_cell("1 + 1", execution_count=3)  # type: ignore[no-untyped-call]
    cell.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=3)]  # type: ignore[no-untyped-call]
    nb.cells = [cell, nbformat.v4.new_markdown_cell("kept")]  # type: ignore[no-untyped-call]
    manager.save({"type": "notebook", "format": "json", "content": nb}, "report.ipynb")  # type: ignore[no-untyped-call]
    saved = json.loads((tmp_path / "report.ipynb").read_text(encoding="utf-8"))
    assert saved["cells"][0]["outputs"] == [] and saved["cells"][0]["execution_count"] is None
    assert "".join(saved["cells"][0]["source"]) == "1 + 1" and "".join(saved["cells"][1]["source"]) == "kept"
    manager.save({"type": "file", "format": "text", "content": "plain"}, "notes.txt")  # type: ignore[no-untyped-call]
    assert (tmp_path / "notes.txt").read_text(encoding="utf-8") == "plain"


def _stub(path: Path, log: Path) -> None:
    path.write_text(f'#!/bin/sh\necho "$(basename "$0") $*" >> {log}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _make_lab(tmp_path: Path, url: str | None) -> list[str]:
    """``make lab`` with stand-ins for composer-ops and jupyter that record their arguments."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("composer-ops", "jupyter"):
        _stub(bin_dir / name, log)
    env = {k: v for k, v in os.environ.items() if k != "COMPOSER_DATABASE_URL"}
    if url:
        env["COMPOSER_DATABASE_URL"] = url
    stamp = tmp_path / "installed"      # newer than everything the venv stamp depends on: nothing to install
    stamp.touch()
    done = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "lab", f"BIN={bin_dir}",
                           f"STAMP={stamp}"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return log.read_text(encoding="utf-8").splitlines()


def test_make_lab_with_a_url_migrates_nothing_and_installs_the_save_hook(tmp_path: Path) -> None:
    calls = _make_lab(tmp_path, "postgresql://ops_reports@db/composer?options=-c%20role%3Dcomposer_ops_reader")
    assert len(calls) == 1 and calls[0].startswith("jupyter lab ")
    assert "--ContentsManager.pre_save_hook=composer_ops.ops.lab.strip_outputs" in calls[0]


def test_make_lab_without_a_url_starts_and_migrates_the_embedded_server(tmp_path: Path) -> None:
    calls = _make_lab(tmp_path, None)
    assert calls[0] == "composer-ops db up" and calls[1].startswith("composer-ops migrate")
    assert calls[2].startswith("jupyter lab ") and "pre_save_hook" in calls[2]


def _as_a_session_leaves_it(model: dict[str, object]) -> None:
    """What a JupyterLab session does to an opened notebook before autosave: the kernel's
    language_info, every code cell run (outputs, execution counts, timings)."""
    content = model["content"]
    assert isinstance(content, dict)
    content["metadata"]["language_info"] = {
        "codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py", "mimetype": "text/x-python",
        "name": "python", "nbconvert_exporter": "python", "pygments_lexer": "ipython3", "version": "3.11.7"}
    for n, cell in enumerate(content["cells"], start=1):
        if cell["cell_type"] == "code":
            cell["execution_count"] = n
            cell["outputs"] = [nbformat.v4.new_output("stream", text="ran\n")]  # type: ignore[no-untyped-call]
            cell["metadata"]["execution"] = {"iopub.status.busy": "2025-01-01T00:00:00.000Z"}


def test_saving_an_unchanged_notebook_through_jupyter_leaves_it_byte_identical(tmp_path: Path) -> None:
    manager = FileContentsManager(root_dir=str(tmp_path), pre_save_hook="composer_ops.ops.lab.strip_outputs")
    stored = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert stored
    for path in stored:
        (tmp_path / path.name).write_bytes(path.read_bytes())
        model = manager.get(path.name, content=True)  # type: ignore[no-untyped-call]
        _as_a_session_leaves_it(model)
        manager.save(model, path.name)  # type: ignore[no-untyped-call]
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), f"{path.name} changed when saved"
