"""What the notebooks show besides charts: key figures, self-checks, anomalies, tables.

Every notebook ends with a cell tagged ``key-figures`` that prints its key figures
(counts, months, run IDs) as canonical JSON through :func:`show_key_figures`. A
report leaves that cell out of its HTML page; the notebook harness compares its
output with the figures the seeded test database must produce
(:mod:`composer_ops.testing.checks`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: The tag of the cell that prints the key figures.
KEY_FIGURES_TAG = "key-figures"


def figures_text(figures: Mapping[str, Any]) -> str:
    """``figures`` as canonical JSON: sorted keys, one item per line, tuples as lists,
    so two equal sets of figures always print the same text."""
    return json.dumps(json.loads(json.dumps(figures, default=str)), indent=1, sort_keys=True)


def show_key_figures(figures: Mapping[str, Any]) -> None:
    """Print the notebook's key figures (see the module docstring)."""
    print(figures_text(figures))
