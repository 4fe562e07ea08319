"""nbval harness for the operations notebooks: ``pytest --nbval-lax notebooks/``.

The notebooks run against a deterministic seeded database
(:mod:`composer_ops.ops.fixtures`) and end with self-checks: invariants, plus the
exact figures of the seed read from ``COMPOSER_OPS_EXPECT``.

When the caller already set ``COMPOSER_OPS_EXPECT`` and ``COMPOSER_DATABASE_URL``
(tests/notebooks/test_nbval.py does, as the read-only role), they are used as they
are. Otherwise this file starts a throwaway server the way the test suite does
(``COMPOSER_DATABASE_URL`` server, else ``COMPOSER_TEST_PGBIN``, else the embedded
one), creates a seeded database on it, and drops it at the end.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_state: dict[str, Any] = {}


def _active(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False))


def pytest_configure(config: pytest.Config) -> None:
    if not _active(config) or os.environ.get("COMPOSER_OPS_EXPECT"):
        return
    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))
    import psycopg

    from composer_ops.db.migrate import migrate
    from composer_ops.ops import fixtures
    from composer_ops.testing import servers

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
                                                    ("COMPOSER_DATABASE_URL", "COMPOSER_OPS_EXPECT")})
    os.environ["COMPOSER_DATABASE_URL"] = url
    os.environ["COMPOSER_OPS_EXPECT"] = str(expect)


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
