"""The psycopg internals the error boundary (``composer_ops.db.errors``) relies on.

``Connection.wait`` and ``Connection._check_connection_ok`` are overridden and
``errors._WaitTimeout`` is let through; none of them is documented API. These tests
fail, naming what moved, when an upgrade of psycopg changes them: the installed
version must be the pinned one, the methods must keep their signatures, and every
sync round trip must still go through ``Connection.wait`` (the only functions of
psycopg's sync modules that call its wait loop directly are ``wait`` itself,
``connect`` and ``cancel_safe``, which the boundary covers otherwise).
"""

from __future__ import annotations

import ast
import inspect
from importlib import metadata
from pathlib import Path

import psycopg
import pytest
from packaging.requirements import Requirement
from psycopg import errors as pgerr
from psycopg_pool import ConnectionPool

from composer_ops.db import errors as boundary


def test_the_installed_psycopg_is_in_the_pinned_series() -> None:
    pins = [Requirement(r) for r in metadata.requires("composer_ops") or []]
    pin = next(r for r in pins if r.name == "psycopg")
    assert pin.specifier.contains(psycopg.__version__), (psycopg.__version__, str(pin.specifier))
    assert not pin.specifier.contains("3.3.5") and not pin.specifier.contains("3.4.0")


def test_the_overridden_methods_keep_their_signatures() -> None:
    wait = inspect.signature(psycopg.Connection.wait)
    assert list(wait.parameters) == ["self", "gen", "interval", "timeout"], wait
    check = inspect.signature(psycopg.Connection._check_connection_ok)
    assert list(check.parameters) == ["self"], check
    assert "timeout" in inspect.signature(psycopg.Connection.notifies).parameters
    assert list(inspect.signature(ConnectionPool.getconn).parameters) == ["self", "timeout"]
    assert boundary.Connection.wait is not psycopg.Connection.wait
    assert boundary.Connection._check_connection_ok is not psycopg.Connection._check_connection_ok


def test_the_wait_timeout_is_a_driver_error_the_boundary_lets_through() -> None:
    assert boundary._WAIT_TIMEOUT is pgerr._WaitTimeout
    assert issubclass(pgerr._WaitTimeout, psycopg.OperationalError)
    # notifies() catches it around self.wait(..., timeout=...): were it translated,
    # an idle LISTEN would end in an error instead of returning.
    source = inspect.getsource(psycopg.Connection.notifies)
    assert "_WaitTimeout" in source and "self.wait(" in source


def _direct_waits() -> set[tuple[str, str, str]]:
    """(module, class, function) of every function in psycopg's sync modules that
    calls the ``waiting`` module itself rather than ``Connection.wait``."""
    root = Path(psycopg.__file__).parent
    found: set[tuple[str, str, str]] = set()
    for path in sorted(root.glob("*.py")):
        if "async" in path.name:
            continue
        tree = ast.parse(path.read_text())
        scopes: list[tuple[str, ast.AST]] = [("", n) for n in tree.body if isinstance(n, ast.FunctionDef)]
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            scopes += [(cls.name, n) for n in cls.body if isinstance(n, ast.FunctionDef)]
        for owner, fn in scopes:
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "waiting":
                    found.add((path.name, owner, fn.name))  # type: ignore[attr-defined]
    return found


def test_every_sync_round_trip_goes_through_connection_wait() -> None:
    assert _direct_waits() == {
        ("connection.py", "Connection", "wait"),
        ("connection.py", "Connection", "connect"),        # boundary.Connection.connect translates
        ("connection.py", "Connection", "cancel_safe"),    # reports nothing: errors are logged
    }


@pytest.mark.parametrize("name", ["cursor", "_server_cursor", "_copy", "_pipeline", "transaction"])
def test_cursors_copies_pipelines_and_transactions_wait_on_their_connection(name: str) -> None:
    source = (Path(psycopg.__file__).parent / f"{name}.py").read_text()
    assert "_conn.wait(" in source or "connection.wait(" in source, name
