"""nbval harness for the operations notebooks: ``pytest --nbval-lax notebooks/``.

The notebooks run against a deterministic seeded database
(:mod:`composer_ops.testing.fixtures`). Each notebook's last code cell prints its
key figures; this harness reads every notebook with the figures the seed must
produce stored as that cell's output, tagged ``nbval-check-output``
(:func:`composer_ops.testing.checks.expect_figures`), so nbval fails the cell when
one figure differs, even under ``--nbval-lax``.

When the caller already set ``COMPOSER_OPS_EXPECT`` (a JSON file of the expected
figures) and ``COMPOSER_DATABASE_URL`` (tests/notebooks/test_nbval.py does, as the
read-only role), they are used as they are. Otherwise this file starts a throwaway
server the way the test suite does (``COMPOSER_DATABASE_URL`` server, else
``COMPOSER_TEST_PGBIN``, else the embedded one), creates a seeded database on it,
and drops it at the end.

Kernels listen on Unix sockets (:mod:`composer_ops.kernels`): two nbval runs side by side
cannot take each other's ports.
"""

from __future__ import annotations

import json
import os
import tempfile
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

_state: dict[str, Any] = {}


def _active(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False))


def pytest_configure(config: pytest.Config) -> None:
    if not _active(config):
        return
    from composer_ops.kernels import use_in_nbval
    from composer_ops.testing.checks import ENV_EXPECT, load_expectations

    use_in_nbval()
    if not os.environ.get(ENV_EXPECT):
        _seed_throwaway_database()
    _read_notebooks_expecting(load_expectations(os.environ[ENV_EXPECT]))


def _seed_throwaway_database() -> None:
    import psycopg

    from composer_ops.db.migrate import migrate
    from composer_ops.testing import fixtures, servers
    from composer_ops.testing.checks import ENV_EXPECT

    server = servers.session().primary
    name = f"composer_nbval_{uuid.uuid4().hex[:8]}"
    url = server.create_database(name)
    migrate(url)
    with psycopg.connect(url) as conn:
        info = fixtures.seed(conn)
        conn.commit()
    expect = Path(tempfile.mkdtemp(prefix="composer-nbval-")) / "expected.json"
    expect.write_text(json.dumps(fixtures.expected_figures(info), indent=1), encoding="utf-8")
    _state.update(server=server, name=name, previous={k: os.environ.get(k) for k in
                                                    ("COMPOSER_DATABASE_URL", ENV_EXPECT)})
    os.environ["COMPOSER_DATABASE_URL"] = url
    os.environ[ENV_EXPECT] = str(expect)


def _read_notebooks_expecting(expected: dict[str, dict[str, Any]]) -> None:
    """nbval reads each notebook with ``nbformat.read``; give it the notebook with
    its expected key figures as the checked output."""
    import nbformat
    import nbval.plugin

    from composer_ops.testing.checks import expect_figures

    class _Reader(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(nbformat, name)

        def read(self, path: str, as_version: int) -> Any:
            nb = nbformat.read(path, as_version=as_version)  # type: ignore[no-untyped-call]
            figures = expected.get(Path(path).stem)
            if figures is not None:
                nb = nbformat.from_dict(expect_figures(nb, figures))  # type: ignore[no-untyped-call]
            return nb

    nbval.plugin.nbformat = _Reader("nbformat")  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    if "name" not in _state:
        return
    for key, value in _state["previous"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _state["server"].drop_database(_state["name"])
    _state.clear()
