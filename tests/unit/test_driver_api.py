"""composer_ops uses psycopg's public API only, so a new psycopg release that keeps its
API works unchanged.

The error boundary (``composer_ops.db.errors``) subclasses psycopg's connection and
cursors and the pool; these tests fail when the package reaches for anything private of
psycopg or psycopg_pool (a ``_`` name imported, read from a module, overridden or read
on one of their objects), when an override no longer names a public method of the class
it overrides, or when the installed psycopg is outside the range pyproject.toml declares.
The integration tests (tests/integration/test_errors.py) check what the
boundary does on a server, against whichever psycopg is installed.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from importlib import metadata
from pathlib import Path

import psycopg
import psycopg_pool
import pytest
from packaging.requirements import Requirement

import composer_ops
from composer_ops.db import errors as boundary

DRIVERS = ("psycopg", "psycopg_pool")
PACKAGE = Path(composer_ops.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@functools.cache
def _driver_private_names() -> frozenset[str]:
    """Every ``_name`` psycopg and psycopg_pool define as a method or set on ``self``."""
    found: set[str] = set()
    for module in (psycopg, psycopg_pool):
        for path in Path(module.__file__ or "").parent.rglob("*.py"):
            found |= set(re.findall(r"(?:\bdef |\bself\.)(_[A-Za-z]\w*)", path.read_text()))
    return frozenset(n for n in found if _private(n))


def _own_private_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every ``_name`` composer_ops defines itself (functions, methods, attributes, names)."""
    found: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                found.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif isinstance(node, ast.arg):
                found.add(node.arg)
    return {n for n in found if _private(n)}


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _private_driver_uses(path: Path, tree: ast.Module, driver_private: frozenset[str], own: set[str]) -> list[str]:
    """Where ``tree`` touches a private name of psycopg or psycopg_pool."""
    where = str(path.relative_to(PACKAGE.parent))
    found: list[str] = []
    aliases: set[str] = set()       # local names bound to a driver module or class
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in DRIVERS:
                    aliases.add(alias.asname or alias.name.split(".")[0])
                    found += [f"{where}:{node.lineno}: import {alias.name}"
                              for part in alias.name.split(".") if _private(part)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in DRIVERS:
            module = node.module or ""
            if any(_private(part) for part in module.split(".")):
                found.append(f"{where}:{node.lineno}: from {module} import ...")
            for alias in node.names:
                aliases.add(alias.asname or alias.name)
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno}: from {module} import {alias.name}")
    driver_classes: list[ast.ClassDef] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(isinstance(_root(b), ast.Name) and _root(b).id in aliases  # type: ignore[attr-defined]
                                                  for b in node.bases):
            driver_classes.append(node)
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node.value)
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append(f"{where}:{node.lineno}: {root.id}...{node.attr}")
            elif node.attr in driver_private and node.attr not in own:
                found.append(f"{where}:{node.lineno}: .{node.attr} (a private name of psycopg)")
    for cls in driver_classes:
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef) and _private(node.name):
                found.append(f"{where}:{node.lineno}: {cls.name} overrides {node.name}")
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Name) and node.value.func.id == "super"):
                found.append(f"{where}:{node.lineno}: {cls.name} calls super().{node.attr}")
    return found


def test_the_package_touches_no_private_name_of_psycopg() -> None:
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}
    driver_private, own = _driver_private_names(), _own_private_names(trees)
    assert {"_check_connection_ok", "_pipeline", "_conn", "_tx"} <= driver_private   # the scan reads psycopg
    found = [use for path, tree in trees.items() for use in _private_driver_uses(path, tree, driver_private, own)]
    assert found == []


@pytest.mark.parametrize("source, what", [
    ("from psycopg import errors as pgerr\nX = pgerr._WaitTimeout\n", "pgerr..._WaitTimeout"),
    ("import psycopg\nclass C(psycopg.Connection):\n    def _check_connection_ok(self): ...\n",
     "C overrides _check_connection_ok"),
    ("import psycopg\nclass C(psycopg.Cursor):\n    def f(self): return super()._fetch_pipeline()\n",
     "C calls super()._fetch_pipeline"),
    ("def f(conn):\n    return conn._pipeline\n", "._pipeline (a private name of psycopg)"),
    ("from psycopg._compat import Self\n", "from psycopg._compat import ..."),
    ("from psycopg.errors import _NO_TRACEBACK\n", "import _NO_TRACEBACK"),
])
def test_the_scan_finds_each_kind_of_private_use(source: str, what: str) -> None:
    path = PACKAGE / "example.py"
    found = _private_driver_uses(path, ast.parse(source), _driver_private_names(), set())
    assert found and any(what in use for use in found), found


def _driver_base(cls: type) -> type:
    return next(b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in DRIVERS)


@pytest.mark.parametrize("name", ["TranslatingConnection", "TranslatingCursor", "TranslatingClientCursor",
                                  "TranslatingServerCursor", "TranslatingPool"])
def test_the_boundary_overrides_public_methods_that_psycopg_still_has(name: str) -> None:
    """An override of a method psycopg renamed or dropped would never run: the
    translation would silently stop there."""
    cls = getattr(boundary, name)
    base = _driver_base(cls)
    overrides = {name for name, value in vars(cls).items() if not (name.startswith("__") and name.endswith("__"))
                 and (callable(value) or isinstance(value, (property, classmethod)))}
    assert not any(name.startswith("_") for name in overrides), overrides
    # Public by its name only: it runs psycopg's internal generators and is not in its documentation.
    assert "wait" not in overrides
    for name in overrides:
        assert callable(getattr(base, name, None)) or isinstance(inspect.getattr_static(base, name, None), property), \
            f"{base.__module__}.{base.__qualname__} has no public {name}"


def test_the_installed_psycopg_is_in_the_declared_range() -> None:
    """pyproject.toml declares psycopg >=3.2.1,<4: tested on 3.2.1 and the newest release
    installed (`make test-psycopg-oldest` and `make test`)."""
    pins = [Requirement(r) for r in metadata.requires("composer_ops") or []]
    pin = next(r for r in pins if r.name == "psycopg")
    assert pin.specifier.contains(psycopg.__version__), (psycopg.__version__, str(pin.specifier))
    assert pin.specifier.contains("3.2.1") and not pin.specifier.contains("3.2.0")
    assert not pin.specifier.contains("4.0.0")
