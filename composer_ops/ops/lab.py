"""JupyterLab on the operations notebooks without their outputs ever reaching git.

``make lab`` installs :func:`strip_outputs` as the contents manager's pre-save hook, so
every save (manual or autosave) writes the notebook without outputs, execution counts or
kernel session details, in the form the stored notebooks are in: saving a notebook that
was run but not edited leaves its file byte for byte as it was. :func:`normalise`
(``python -m composer_ops.ops.lab FILE...``) writes a notebook in that form.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def strip_outputs(model: dict[str, Any], **_: Any) -> None:
    """Jupyter pre-save hook: clear every code cell's outputs and execution count, and
    what the kernel session added to the metadata, in a notebook ``model`` about to be
    saved (other files pass unchanged)."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    content = model["content"]
    for cell in content.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        if isinstance(cell.get("metadata"), dict):
            cell["metadata"].pop("execution", None)      # timings JupyterLab records when a cell runs
    meta = content.get("metadata")
    info = meta.get("language_info") if isinstance(meta, dict) else None
    if isinstance(meta, dict) and isinstance(info, dict) and "name" in info:
        # The running kernel fills in its version, lexer and mime type: the machine's, not the notebook's.
        meta["language_info"] = {"name": info["name"]}


def normalise(path: Path) -> bool:
    """Write the notebook at ``path`` as a save through JupyterLab with
    :func:`strip_outputs` writes it; True when that changed the file."""
    import nbformat

    before = path.read_text(encoding="utf-8")
    nb = nbformat.reads(before, as_version=4)  # type: ignore[no-untyped-call]
    strip_outputs({"type": "notebook", "content": nb})
    after: str = nbformat.writes(nb, version=nbformat.NO_CONVERT)  # type: ignore[no-untyped-call]
    after = after if after.endswith("\n") else after + "\n"
    changed = after != before
    if changed:
        path.write_text(after, encoding="utf-8")
    return changed


if __name__ == "__main__":
    for name in sys.argv[1:]:
        if normalise(Path(name)):
            print(f"normalised {name}")
