"""``composer-ops partitions`` and the notebooks name the run-scoped tables as they are
(four: repo.partitions.RUN_TABLES), not a count left over from when there were three."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from composer_ops.cli import main
from composer_ops.repo.partitions import RUN_TABLES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["partitions", "--help"], ["partitions", "drop", "--help"]])
def test_partitions_help_names_every_run_scoped_table(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    text = " ".join(capsys.readouterr().out.split())
    assert "three" not in text
    assert all(table in text for table in RUN_TABLES), text


def test_no_notebook_says_three_run_scoped_tables() -> None:
    assert len(RUN_TABLES) == 4
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"three (run-scoped )?tables", text), path.name
