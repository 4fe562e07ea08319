"""``make_pool(wait_s=...)``: how long a starting service waits for the database, and
that only failures that may pass are waited out."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from psycopg.conninfo import make_conninfo

from composer_ops.db.connect import make_pool, wait_until_reachable
from composer_ops.errors import Invalid, Unavailable


def test_an_unreachable_server_is_retried_until_the_wait_is_over(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="composer_ops.db.connect")
    nowhere = f"postgresql://composer@/composer?host={tmp_path}"   # no server has a socket there
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"cannot connect to the database \(waited 1s\): .*No such file"):
        make_pool(nowhere, wait_s=1.0)
    took = time.monotonic() - started
    assert 1.0 <= took < 15.0                  # bounded by the wait (and a loaded machine's slack)
    attempts = [r.getMessage() for r in caplog.records if "cannot connect to the database yet" in r.getMessage()]
    assert len(attempts) >= 2 and "No such file or directory" in attempts[0], attempts


def test_without_a_wait_it_fails_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"^cannot connect to the database: "):
        wait_until_reachable(f"postgresql://composer@/composer?host={tmp_path}")
    assert time.monotonic() - started < 5.0     # one attempt, no wait (the wait above is 1 s and retries)


def test_a_permanent_refusal_is_not_waited_for(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="composer_ops.db.connect")
    started = time.monotonic()
    with pytest.raises(Unavailable, match='role "no_such_role_here" does not exist'):
        make_pool(make_conninfo(db_url, user="no_such_role_here"), wait_s=30.0)
    assert time.monotonic() - started < 5.0
    assert not [r for r in caplog.records if "yet" in r.getMessage()]


def test_a_negative_wait_is_refused() -> None:
    with pytest.raises(Invalid, match="0 or more seconds"):
        wait_until_reachable("postgresql://x@/y?host=/nonexistent", wait_s=-1)
