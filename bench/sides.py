"""One source tree of a side-by-side benchmark: its processes import its code, its
database is migrated by its SQL.

``bench.ab`` and ``bench/aba.py`` compare trees on one server. Two things made every
side run on the schema of the tree the harness started from: the template database was
migrated by the harness's own ``migrate``, and the editable install maps the data
package ``composer_ops.migrations`` to the installed checkout's ``sql/`` whatever
``PYTHONPATH`` says (its finder answers for a submodule that the tree's
``composer_ops/`` does not hold). Here every child of a side runs through
:data:`BOOT`: with the side's tree as working directory and ``PYTHONPATH``, it imports
that tree's ``composer_ops``, binds ``composer_ops.migrations`` to that tree's
``sql/``, refuses to go on when either comes from elsewhere, and appends both paths to
``BENCH_IMPORT_LOG`` when set. :func:`make_template` migrates a side's template
database with ``python -m composer_ops migrate`` run that way and deploys the
benchmark's workflows with the side's ``Engine``, so each side's databases are cloned
from a template its own tree made; both templates live on the same server.

Self-contained (the standard library and psycopg only): ``bench/aba.py`` loads this
file by path, whatever older tree supplies the rest of the harness.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg

#: ``python -c BOOT -m MODULE ARGS...`` (or ``-c CODE ARGS...``), run with the side's
#: tree as working directory and ``PYTHONPATH``.
BOOT = r"""
import importlib.util, json, os, runpy, sys
root = os.path.realpath(os.getcwd())
import composer_ops
sql = os.path.join(root, "sql")
def inside(path):
    return os.path.realpath(path).startswith(root + os.sep)
if not inside(composer_ops.__file__) or not os.path.isfile(os.path.join(sql, "__init__.py")):
    sys.exit(f"bench side {root}: composer_ops from {composer_ops.__file__}, or no sql/__init__.py in the tree")
spec = importlib.util.spec_from_file_location("composer_ops.migrations", os.path.join(sql, "__init__.py"),
                                              submodule_search_locations=[sql])
migrations = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = migrations
spec.loader.exec_module(migrations)
composer_ops.migrations = migrations
log = os.environ.get("BENCH_IMPORT_LOG")
if log:
    with open(log, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:3], "composer_ops": composer_ops.__file__,
                            "migrations": migrations.__file__}) + "\n")
kind, target, *rest = sys.argv[1:]
if kind == "-m":
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.argv = ["-c", *rest]
    exec(compile(target, "<bench side>", "exec"), {"__name__": "__main__"})
"""

_DEPLOY = """
import json, os, sys
from composer_ops import Engine
with Engine.connect(os.environ["COMPOSER_DATABASE_URL"], pool_size=1, application_name="bench-setup") as engine:
    for spec in json.load(sys.stdin):
        engine.deploy(spec)
"""


def argv(*args: str) -> list[str]:
    """The command line of a side's child: ``args`` is ``-m MODULE ...`` or ``-c CODE ...``."""
    return [sys.executable, "-c", BOOT, *args]


def env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root), **(extra or {})}


def run(root: Path, *args: str, extra_env: dict[str, str] | None = None, stdin: str | None = None,
        timeout: float = 600) -> str:
    """Run a side's child to its end; its stdout (a failure raises with its stderr)."""
    out = subprocess.run(argv(*args), cwd=root, env=env(root, extra_env), input=stdin, capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"bench side {root}: {' '.join(args[:2])} exited with {out.returncode}\n"
                           f"{out.stderr[-3000:]}")
    return out.stdout


def read_imports(path: Path) -> list[dict[str, Any]]:
    """The lines :data:`BOOT` appended to ``path`` (and the file removed)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.unlink()
    return rows


def imported(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Which ``composer_ops`` and which ``sql/`` the processes of ``rows`` imported."""
    return {"composer_ops": sorted({str(Path(r["composer_ops"]).parent) for r in rows}),
            "migrations": sorted({str(Path(r["migrations"]).parent) for r in rows})}


def sql_files(root: Path) -> dict[str, str]:
    """The tree's plain migration files (V and R) as ``schema_migrations`` names them,
    each with its checksum (sha256 of the file, as ``migrate`` computes it)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "sql").iterdir()) if p.suffix == ".sql" and p.name[:1] in "VR"}


def make_template(server: Any, root: Path, name: str, workflows: list[dict[str, Any]]) -> dict[str, Any]:
    """Create database ``name`` on ``server``, migrate it with ``root``'s own
    ``python -m composer_ops migrate`` and deploy ``workflows`` with ``root``'s
    ``Engine``; refused unless the migrations it records are exactly the tree's files.
    Returns what was made: the template, the tree, the migrations applied, the imports."""
    url = server.create_database(name)
    fd, path = tempfile.mkstemp(prefix="bench-imports-", suffix=".jsonl")
    os.close(fd)
    log = Path(path)
    extra = {"COMPOSER_DATABASE_URL": url, "BENCH_IMPORT_LOG": str(log)}
    run(root, "-m", "composer_ops", "migrate", extra_env=extra)
    run(root, "-c", _DEPLOY, extra_env=extra, stdin=json.dumps(workflows))
    with psycopg.connect(url) as conn:
        if conn.execute("SELECT 1 FROM information_schema.columns "
                        "WHERE table_name = 'schema_migrations' AND column_name = 'script'").fetchone():
            applied = {str(s): str(c) for s, c in conn.execute("SELECT script, checksum FROM schema_migrations")}
        else:       # a tree from before the table named files (c3b698e and earlier): V files only, by version
            applied = {f"V{int(v):03d}__{n}.sql": str(c)
                       for v, n, c in conn.execute("SELECT version, name, checksum FROM schema_migrations")}
    expected = sql_files(root)
    if applied != expected:
        raise RuntimeError(f"template {name} of {root}: schema_migrations holds {sorted(applied)}, "
                           f"the tree's sql/ {sorted(expected)} (or a checksum differs)")
    return {"template": name, "tree": str(root), "migrations": {k: v[:12] for k, v in sorted(applied.items())},
            "imports": imported(read_imports(log))}
