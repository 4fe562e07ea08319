"""The key figures a notebook prints, and the checked output the harness gives that
cell (no database needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from composer_ops.errors import Invalid
from composer_ops.ops.display import figures_text
from composer_ops.testing.checks import NBVAL_CHECK, expect_figures, load_expectations


def test_figures_print_the_same_whatever_the_container_types_and_key_order() -> None:
    assert figures_text({"b": (1, 2), "a": {"2": 1, "1": 3}}) == figures_text({"a": {"1": 3, "2": 1}, "b": [1, 2]})
    assert json.loads(figures_text({"months": ("202501",)})) == {"months": ["202501"]}


def test_the_key_figures_cell_gets_the_expected_output_and_the_check_tag() -> None:
    nb: dict[str, Any] = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "source": "x = 1"},
                    {"cell_type": "code", "metadata": {"tags": ["key-figures"]}, "outputs": [], "source": "show"}]}
    expect_figures(nb, {"active": 10})
    last = nb["cells"][-1]
    assert last["metadata"]["tags"] == ["key-figures", NBVAL_CHECK]
    assert last["outputs"] == [{"output_type": "stream", "name": "stdout", "text": figures_text({"active": 10}) + "\n"}]
    assert nb["cells"][0]["outputs"] == []


def test_a_notebook_without_exactly_one_key_figures_cell_is_invalid() -> None:
    with pytest.raises(Invalid, match="exactly one cell tagged 'key-figures', found 0"):
        expect_figures({"cells": [{"cell_type": "code", "metadata": {}}]}, {})


def test_an_unreadable_expectation_file_is_invalid(tmp_path: Path) -> None:
    with pytest.raises(Invalid):
        load_expectations(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(Invalid):
        load_expectations(bad)
