"""The package installs from its wheel and from its sdist and works outside the checkout.

The wheel and the sdist are built from a copy of this tree (``python -m build``); each
is installed into a fresh venv under a temporary directory, and every command runs
there, with that directory as its working directory and no PYTHONPATH, so nothing
can be imported from the checkout. Against an empty database of the suite's server:
``composer-ops migrate`` applies every migration of sql/, a workflow (TASK, SWITCH,
WAIT, WAIT_FOR_SIGNAL) is deployed with ``composer-ops deploy``, started, signalled and
run to SUCCEEDED by a real ``composer-ops worker`` (the shipped test app) and a
``composer-ops coordinator``, and ``composer-ops report --all`` renders every shipped
notebook.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest

from composer_ops import __version__
from composer_ops.testing.processes import Fleet, wait_for

# The first test pays for building both artifacts and installing both venvs (module
# fixtures): about 2 to 3 minutes alone, up to 5 on a machine busy with other work.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

ROOT = Path(__file__).resolve().parents[2]
#: Every migration file of sql/ (V and repeatable R files): the plain series and the Citus one (sql/citus/).
MIGRATIONS = sorted(p.relative_to(ROOT / "sql").as_posix() for p in (ROOT / "sql").rglob("*.sql"))
#: The versions ``composer-ops migrate`` applies to plain PostgreSQL, and its repeatable files.
PLAIN_VERSIONS = sorted(int(p.name[1:].split("__")[0]) for p in (ROOT / "sql").glob("V*.sql"))
PLAIN_REPEATABLE = sorted(p.name for p in (ROOT / "sql").glob("R__*.sql"))
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
RUNBOOKS = sorted(p.stem for p in (ROOT / "notebooks" / "runbooks").glob("*.ipynb"))

SPEC = {
    "id": "packaged", "name": "Installed from the package",
    "nodes": [
        {"id": "tier", "type": "TASK", "task": "tier", "input": {"amount": "$.input.amount"}},
        {"id": "route", "type": "SWITCH", "depends_on": ["tier"], "expression": "$.nodes.tier.output.tier",
         "cases": {"gold": ["express"]}, "default": ["standard"]},
        {"id": "express", "type": "TASK", "task": "work", "depends_on": ["route"], "input": {"fail_until": 1},
         "retry": {"max_attempts": 3, "initial_backoff_s": 0.1}},
        {"id": "standard", "type": "TASK", "task": "work", "depends_on": ["route"]},
        {"id": "pause", "type": "WAIT", "depends_on": ["express", "standard"], "duration_s": 0.2},
        {"id": "delivered", "type": "WAIT_FOR_SIGNAL", "depends_on": ["pause"], "signal": "delivered",
         "timeout_s": 600},
        {"id": "notify", "type": "TASK", "task": "notify", "depends_on": ["delivered"],
         "input": {"proof": "$.nodes.delivered.output"}},
    ],
}


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist, and the wheel that ``build`` makes from it, of a copy of this tree."""
    base = tmp_path_factory.mktemp("dist")
    source = base / "source"
    # The files a clean checkout of this tree would hold (tracked, or new and not
    # ignored): no local state, caches or earlier build output.
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT)
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = base / "out"
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(source)], cwd=base, timeout=240)
    [wheel], [sdist] = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def venvs(dists: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A fresh venv per artifact with it installed (both installs at once: they wait on
    the disk more than on the CPU). The installing pip runs outside the checkout too."""
    base = tmp_path_factory.mktemp("venvs")

    def install(kind: str) -> Path:
        venv = base / kind
        _run([sys.executable, "-m", "venv", str(venv)], cwd=base)
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile", str(dists[kind])],
             cwd=base, env=_outside_env(), timeout=280)
        return venv

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(dists, pool.map(install, dists), strict=True))


def test_the_wheel_holds_every_module_migration_and_notebook(dists: dict[str, Path]) -> None:
    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = set(whl.namelist())
    # Every file of the package in the checkout: modules, py.typed, any data beside them.
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "composer_ops"], cwd=ROOT)
    package = {n for n in listed.split("\0") if n and (ROOT / n).is_file()}
    assert package <= names, sorted(package - names)
    assert {f"composer_ops/migrations/{m}" for m in MIGRATIONS} <= names
    assert {f"composer_ops/notebooks/{n}.ipynb" for n in NOTEBOOKS} <= names
    assert RUNBOOKS and {f"composer_ops/notebooks/runbooks/{n}.ipynb" for n in RUNBOOKS} <= names
    assert "composer_ops/py.typed" in names
    with zipfile.ZipFile(dists["wheel"]) as whl:
        meta = whl.read(f"composer_ops-{__version__}.dist-info/METADATA").decode()
        licence = whl.read(f"composer_ops-{__version__}.dist-info/licenses/LICENSE").decode()
    assert f"\nVersion: {__version__}\n" in meta and "\nLicense-Expression: Apache-2.0\n" in meta
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    with tarfile.open(dists["sdist"]) as sdist:
        held = set(sdist.getnames())
    top = f"composer_ops-{__version__}"
    assert {f"{top}/{name}" for name in ("CHANGELOG.md", "LICENSE")} <= held
    # The relative links of the readme (the docs, their images) resolve inside the sdist.
    readme = next(ROOT.glob("README.*")).read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#\s]+)", readme))
    assert linked and {f"{top}/{link}" for link in linked} <= held, sorted(linked)
    # The data packages carry data only: the notebooks' test conftest stays in the tree.
    assert not [n for n in names if n.startswith(("composer_ops/notebooks/", "composer_ops/migrations/"))
                and n.endswith(".py") and not n.endswith("/__init__.py")]


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_package_migrates_runs_a_workflow_and_renders_every_report(
        kind: str, venvs: dict[str, Path], empty_db_url: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    venv = venvs[kind]
    env = {**_outside_env(), "COMPOSER_DATABASE_URL": empty_db_url, "COMPOSER_HOME": str(work / "home"),
           "COMPOSER_REPORT_PROGRESS": "0"}
    composer_ops = str(venv / "bin" / "composer-ops")

    def cli(*args: str, timeout: float = 120) -> str:
        return _run([composer_ops, *args], cwd=work, env=env, timeout=timeout)

    where = _run([str(venv / "bin" / "python"), "-c", "import composer_ops; print(composer_ops.__file__)"],
                 cwd=work).strip()
    assert Path(where).is_relative_to(venv), where
    assert cli("--version") == f"composer-ops {__version__}\n"

    cli("migrate")
    with psycopg.connect(empty_db_url) as conn:
        applied = [r[0] for r in conn.execute(
            "SELECT version FROM schema_migrations WHERE version IS NOT NULL ORDER BY version")]
        repeatable = [r[0] for r in conn.execute(
            "SELECT script FROM schema_migrations WHERE version IS NULL ORDER BY script")]
    assert applied == PLAIN_VERSIONS
    assert repeatable == PLAIN_REPEATABLE and "R__claim.sql" in repeatable

    (work / "packaged.json").write_text(json.dumps(SPEC), encoding="utf-8")
    assert "deployed packaged v1" in cli("deploy", "packaged.json")
    run_id = cli("start", "packaged", "--input", json.dumps({"amount": 150})).strip()
    with Fleet(empty_db_url, command=[composer_ops], cwd=work, env=env) as fleet:
        fleet.worker(concurrency=2)
        fleet.coordinator()
        waiting = wait_for(lambda: (r := json.loads(cli("runs", "show", run_id, "--json")))["status"] != "RUNNING"
                           or _tasks(r).get("delivered") == "WAITING" and r, timeout=60, interval=0.5,
                           what="the run to wait for its signal")
        assert waiting["status"] == "RUNNING", waiting
        cli("signal", run_id, "delivered", "--payload", json.dumps({"by": kind}))
        run = wait_for(lambda: (r := json.loads(cli("runs", "show", run_id, "--json")))["status"] == "SUCCEEDED"
                       and r, timeout=60, interval=0.5, what="the run to succeed")
        assert fleet.crashes == [] and len(fleet.alive()) == 2
    assert _tasks(run) == {"tier": "COMPLETED", "route": "COMPLETED", "express": "COMPLETED",
                           "standard": "SKIPPED", "pause": "COMPLETED", "delivered": "COMPLETED",
                           "notify": "COMPLETED"}, run
    assert run["output"]["notify"]["input"] == {"proof": {"by": kind}}

    cli("report", "--all", "--jobs", "2", "--out", str(work / "reports"), timeout=240)
    for name in NOTEBOOKS:
        assert len(list((work / "reports" / name).glob("*.html"))) == 1, name
    index = (work / "reports" / "index.html").read_text(encoding="utf-8")
    assert all(name in index for name in NOTEBOOKS)


def _outside_env() -> dict[str, str]:
    """This process's environment without anything that would import from the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _tasks(run: str | dict[str, Any]) -> dict[str, str]:
    doc = json.loads(run) if isinstance(run, str) else run
    return {t["node_id"]: t["state"] for t in doc["tasks"]}


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result.stdout
