"""The version is written once (``composer_ops.__version__``): the package metadata, the
CLI's ``--version`` and the changelog all agree with it."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import composer_ops
from composer_ops.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_composer_ops_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"composer-ops {composer_ops.__version__}\n"
    assert composer_ops.__version__ == "0.1.0"


def test_the_version_is_written_in_one_place() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "composer_ops.__version__"}
    assert metadata.version("composer_ops") == composer_ops.__version__


def test_the_changelog_has_a_section_for_this_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## \[([^\]]+)\]", changelog, flags=re.MULTILINE)
    assert headings[:2] == ["Unreleased", composer_ops.__version__], headings
