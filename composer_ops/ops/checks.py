"""Self-checks the notebooks end with.

Each notebook collects the key figures it showed (counts, months, run IDs) in a
``figures`` dict and calls :func:`verify_figures`. In production nothing is
expected and the call only lists the figures. CI (the nbval harness) seeds a
database with :mod:`composer_ops.ops.fixtures` and points ``COMPOSER_OPS_EXPECT``
at a JSON file of the figures that seed must produce, so a query that returns a
wrong number fails the notebook, not just a reviewer's eye.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

from composer_ops.errors import Invalid

ENV_EXPECT = "COMPOSER_OPS_EXPECT"


def load_expectations(notebook: str, path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The expected figures of ``notebook`` from ``path`` (default: ``$COMPOSER_OPS_EXPECT``),
    or None when no expectation file is configured."""
    target = path if path is not None else os.environ.get(ENV_EXPECT)
    if not target:
        return None
    try:
        doc = json.loads(Path(target).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise Invalid(f"{ENV_EXPECT}={target}: cannot read expected figures ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(notebook, {}), dict):
        raise Invalid(f"{ENV_EXPECT}={target}: expected a JSON object of notebook name -> figures")
    section = doc.get(notebook)
    return None if section is None else dict(section)


def _normal(value: Any) -> Any:
    """JSON round trip, so tuples equal lists and dict key types do not matter."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def verify_figures(notebook: str, figures: Mapping[str, Any], *,
                   expected: Mapping[str, Any] | None = None) -> pl.DataFrame:
    """Compare ``figures`` with the expected ones (argument, else the expectation file).

    Returns one row per figure (figure, value, expected, ok). Raises AssertionError
    naming every figure that differs, or an expected figure the notebook did not produce.
    """
    wanted = dict(expected) if expected is not None else load_expectations(notebook)
    rows: list[tuple[str, str, str | None, bool | None]] = []
    for key in sorted(figures):
        value = _normal(figures[key])
        if wanted is None or key not in wanted:
            rows.append((key, json.dumps(value), None, None))
        else:
            want = _normal(wanted[key])
            rows.append((key, json.dumps(value), json.dumps(want), value == want))
    missing = sorted(set(wanted or {}) - set(figures))
    table = pl.DataFrame(rows, orient="row", schema={
        "figure": pl.String, "value": pl.String, "expected": pl.String, "ok": pl.Boolean})
    bad = [f"{k}: got {v}, expected {e}" for k, v, e, ok in rows if ok is False]
    if bad or missing:
        lines = bad + [f"{k}: expected but not produced" for k in missing]
        raise AssertionError(f"{notebook}: {len(lines)} figure(s) differ from the expected ones:\n  "
                             + "\n  ".join(lines))
    return table
