"""verify_figures: the notebooks' last cell (no database needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_ops.errors import Invalid
from composer_ops.ops.checks import ENV_EXPECT, load_expectations, verify_figures


def test_without_expectations_the_figures_are_only_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_EXPECT, raising=False)
    table = verify_figures("nb", {"b": 2, "a": [1, 2]})
    assert table.rows() == [("a", "[1, 2]", None, None), ("b", "2", None, None)]


def test_matching_figures_pass_whatever_the_container_types(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"nb": {"months": ["202501"], "by": {"1": 3}}}))
    monkeypatch.setenv(ENV_EXPECT, str(path))
    table = verify_figures("nb", {"months": ("202501",), "by": {1: 3}, "extra": 5})
    assert table.filter(table["ok"].is_not_null())["ok"].to_list() == [True, True]
    assert load_expectations("other") is None


def test_a_wrong_or_missing_figure_fails_naming_it() -> None:
    with pytest.raises(AssertionError) as err:
        verify_figures("nb", {"active": 9, "groups": 7}, expected={"active": 10, "groups": 7, "runs": 9})
    text = str(err.value)
    assert "active: got 9, expected 10" in text and "runs: expected but not produced" in text
    assert "groups" not in text


def test_an_unreadable_expectation_file_is_invalid(tmp_path: Path) -> None:
    with pytest.raises(Invalid):
        load_expectations("nb", tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(Invalid):
        load_expectations("nb", bad)
