"""Helpers for the notebook tests: a seeded database, the reader role's URL, and
nbval run in a subprocess exactly as a developer would run it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
import pytest

from composer_ops.testing import fixtures

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
READER = "composer_ops_reader"


def seed_committed(url: str) -> fixtures.SeedInfo:
    with psycopg.connect(url) as conn:
        info = fixtures.seed(conn)
        conn.commit()
    return info


def as_role(url: str, role: str = READER) -> str:
    """The same URL, with the session switched to ``role`` at start-up (libpq options)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "options"]
    query.append(("options", f"-c role={role}"))
    return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))


def code_cells(path: Path) -> int:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return sum(1 for c in nb["cells"] if c["cell_type"] == "code")


def code_cell_index(path: Path, needle: str) -> int:
    """nbval's number ("Cell N") of the first code cell whose source contains ``needle``."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    return next(i for i, src in enumerate(sources) if needle in src)


def run_nbval(paths: list[Path], env: dict[str, str], *, rootdir: Path = ROOT,
              timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m pytest --nbval-lax PATHS`` with the current interpreter as the kernel
    and the project's pytest configuration; kernels on Unix sockets
    (tests/notebooks/unix_kernels.py), so runs side by side cannot take each other's ports."""
    cmd = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(rootdir),
           "--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=120",
           "-p", "no:cacheprovider", "-p", "tests.notebooks.unix_kernels", "-q", "-rf", "--no-header",
           # nbval starts each kernel with stderr=open(os.devnull, "w") and never closes it;
           # the file is finalized whenever the garbage collector gets to it, anywhere in the
           # run (an import under assertion rewriting), and `filterwarnings = error` would
           # fail whatever runs then. Only that file's warnings (the wrapper's, and the raw
           # file's when the collector finalizes it first) are ignored, only here.
           "-W", f"ignore:unclosed file <_io.TextIOWrapper name='{os.devnull}' mode='w':ResourceWarning",
           "-W", f"ignore:unclosed file <_io.FileIO name='{os.devnull}' mode='wb':ResourceWarning",
           *[str(p) for p in paths]]
    # A nested pytest prints its short summary in full when it believes it runs on CI (the CI and
    # BUILD_NUMBER variables): its output must read the same here and on CI.
    full_env = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")} | env
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout, check=False)


def run_nbval_parallel(groups: list[list[Path]], env: dict[str, str], *, rootdir: Path = ROOT,
                       timeout: float = 240) -> list[subprocess.CompletedProcess[str]]:
    """:func:`run_nbval` for several groups of notebooks at once (one subprocess each)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        return list(pool.map(lambda g: run_nbval(g, env, rootdir=rootdir, timeout=timeout), groups))


def passed_count(output: str) -> int:
    m = re.search(r"(\d+) passed", output)
    return int(m.group(1)) if m else 0


def failed_items(output: str) -> list[str]:
    """The ``FAILED path::Cell N`` lines of a -rf summary."""
    return re.findall(r"^FAILED (\S+::Cell \d+)", output, flags=re.MULTILINE)


def inject_after_parameters(source: Path, target: Path, code: str) -> Path:
    """Copy a notebook, adding a code cell right after its parameters cell."""
    nb: dict[str, Any] = json.loads(source.read_text(encoding="utf-8"))
    index = next(i for i, c in enumerate(nb["cells"]) if "parameters" in c.get("metadata", {}).get("tags", []))
    nb["cells"].insert(index + 1, {"cell_type": "code", "id": "injected-break", "metadata": {},
                                   "execution_count": None, "outputs": [], "source": code})
    target.write_text(json.dumps(nb, indent=1), encoding="utf-8")
    return target


def hold_first_kernel_port(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """The race a kernel on TCP can lose, forced: jupyter_client's first free port is
    ``port`` (one the caller holds, as another process would); the kernel's other four
    are jupyter_client's own choice, so only the held one can kill the kernel."""
    from jupyter_client.connect import LocalPortCache

    choose = LocalPortCache.find_available_port
    handed: list[int] = []

    def first_held(self: LocalPortCache, ip: str) -> int:
        handed.append(port if not handed else choose(self, ip))
        return handed[-1]

    monkeypatch.setattr(LocalPortCache, "find_available_port", first_held)
