"""JupyterLab on the operations notebooks without their outputs ever reaching git.

``make lab`` starts JupyterLab with :func:`strip_outputs` as the contents manager's
pre-save hook: opening a notebook marks it modified and autosave writes it, so every
save (manual or automatic) writes the notebook without outputs and execution
counts. The stored notebooks stay templates; run one as a report
(``composer-ops report NAME``) to keep what it showed.
"""

from __future__ import annotations

from typing import Any


def strip_outputs(model: dict[str, Any], **_: Any) -> None:
    """Jupyter pre-save hook: clear every code cell's outputs and execution count in a
    notebook ``model`` about to be saved (other files pass unchanged)."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    for cell in model["content"].get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
