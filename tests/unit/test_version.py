"""The version is written once (``composer_ops.__version__``): the package metadata, the
CLI's ``--version`` and the changelog all agree with it."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

import composer_ops
from composer_ops.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_composer_ops_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"composer-ops {composer_ops.__version__}\n"
    assert composer_ops.__version__ == "0.2.0.dev0"


def test_the_version_is_written_in_one_place() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "composer_ops.__version__"}
    assert metadata.version("composer_ops") == composer_ops.__version__


def test_the_changelog_has_a_section_for_this_version() -> None:
    """A development version (the checkout between releases) is newer than the last
    release the changelog dates, and its changes are under [Unreleased]; a release has
    a section of its own, first."""
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## \[([^\]]+)\]", changelog, flags=re.MULTILINE)
    version = Version(composer_ops.__version__)
    if version.is_devrelease:
        assert headings[0] == "Unreleased" and Version(headings[1]) < version, headings
        assert f"version is {composer_ops.__version__}" in changelog.split("\n## [", 2)[1]
    else:
        assert headings[0] == composer_ops.__version__, headings
