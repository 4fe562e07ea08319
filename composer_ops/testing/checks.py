"""The notebooks' key figures checked against the ones a seeded database must produce.

The last code cell of every notebook (tagged ``key-figures``) prints its figures
with :func:`composer_ops.ops.display.show_key_figures`. :func:`expect_figures`
stores the expected text as that cell's output and tags it ``nbval-check-output``,
so nbval (even with ``--nbval-lax``) fails the cell, with a diff, when one figure
differs. The expected figures come from :func:`composer_ops.testing.fixtures.expected_figures`,
written by hand from the seed, not computed by the code under test.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from composer_ops.errors import Invalid
from composer_ops.ops.display import KEY_FIGURES_TAG, figures_text

#: The harness's variable: a JSON file of notebook name -> expected figures.
ENV_EXPECT = "COMPOSER_OPS_EXPECT"
NBVAL_CHECK = "nbval-check-output"


def load_expectations(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The expected figures of every notebook, from a JSON file."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise Invalid(f"{path}: cannot read expected figures ({exc})") from None
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise Invalid(f"{path}: expected a JSON object of notebook name -> figures")
    return doc


def expect_figures(nb: dict[str, Any], figures: Mapping[str, Any]) -> dict[str, Any]:
    """``nb`` (a notebook as JSON, changed in place and returned) with ``figures`` as
    the checked output of its key-figures cell. :class:`Invalid` if it has none, or
    more than one."""
    cells = [c for c in nb.get("cells", []) if KEY_FIGURES_TAG in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise Invalid(f"a notebook needs exactly one cell tagged {KEY_FIGURES_TAG!r}, found {len(cells)}")
    cell = cells[0]
    cell["metadata"]["tags"] = [*cell["metadata"]["tags"], NBVAL_CHECK]
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": figures_text(figures) + "\n"}]
    cell["execution_count"] = 1  # nbval compares only the outputs of a cell that was run
    return nb


def write_expecting(source: Path, target: Path, figures: Mapping[str, Any]) -> Path:
    """Copy the notebook at ``source`` to ``target`` with ``figures`` as its checked key figures."""
    nb = json.loads(source.read_text(encoding="utf-8"))
    target.write_text(json.dumps(expect_figures(nb, figures), indent=1), encoding="utf-8")
    return target
