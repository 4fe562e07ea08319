"""``--require DIR=N`` (tests/conftest.py) fails a leg that collects too few tests under
DIR or skips all of them, in one pytest process and under pytest-xdist (``-n 2``), where
the tests run in workers and each worker sees only part of them. Each case is a nested
pytest run of a small tree that uses the suite's own conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Three tests under tests/a; under tests/b one that runs unless SKIP_B is set and two skipped.
FILES = {
    "tests/a/test_a.py": "def test_one():\n    pass\n\ndef test_two():\n    pass\n\ndef test_three():\n    pass\n",
    "tests/b/test_b.py": ("import os, pytest\n\n"
                          "@pytest.mark.skipif(bool(os.environ.get('SKIP_B')), reason='asked')\n"
                          "def test_runs():\n    pass\n\n"
                          "@pytest.mark.skip(reason='always')\ndef test_skipped():\n    pass\n\n"
                          "@pytest.mark.skip(reason='always')\ndef test_skipped_too():\n    pass\n"),
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("require")
    (root / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    (root / "tests").mkdir()
    shutil.copy(CONFTEST, root / "tests" / "conftest.py")
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def nested(tree: Path, *args: str, skip_b: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COMPOSER_DATABASE_URL", "SKIP_B", "PYTEST_ADDOPTS")}
    env.update({"COMPOSER_TEST_NO_SERVER": "1", "PYTHONPATH": str(ROOT)})
    if skip_b:
        env["SKIP_B"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--rootdir", str(tree), "-c", str(tree / "pytest.ini"), *args, "tests"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=240, check=False)


MODES = [pytest.param([], id="one-process"), pytest.param(["-p", "xdist", "-n", "2"], id="xdist")]


@pytest.mark.parametrize("mode", MODES)
def test_a_leg_with_enough_tests_that_run_passes(tree: Path, mode: list[str]) -> None:
    result = nested(tree, *mode, "--require", "tests/a=3", "--require", "tests/b=3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "4 passed, 2 skipped" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("mode", MODES)
def test_too_few_tests_under_a_directory_fail_the_leg(tree: Path, mode: list[str]) -> None:
    result = nested(tree, *mode, "--require", "tests/a=4")
    assert result.returncode != 0, result.stdout[-3000:]
    assert "too few tests collected: tests/a: 3 selected, at least 4 expected" in result.stdout + result.stderr, \
        result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("mode", MODES)
def test_a_directory_whose_tests_all_skip_fails_the_leg(tree: Path, mode: list[str]) -> None:
    result = nested(tree, *mode, "--require", "tests/a=3", "--require", "tests/b=3", skip_b=True)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no test ran (all skipped) under: tests/b" in result.stdout, result.stdout[-3000:]
