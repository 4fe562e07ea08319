"""The ops' own connections: a read behind a lock held elsewhere gives up after the
lock wait, naming the holders; any other lock timeout passes through as raised."""

from __future__ import annotations

import time

import psycopg
import pytest

from composer_ops import ops
from composer_ops.errors import LockTimeout


def test_a_read_behind_a_held_lock_gives_up_naming_the_holder(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPOSER_LOCK_WAIT", "0.5")
    with psycopg.connect(db_url, application_name="long-alter") as holder:
        holder.execute("LOCK TABLE task_instances IN ACCESS EXCLUSIVE MODE")
        began = time.monotonic()
        with pytest.raises(LockTimeout) as raised:
            ops.active_by_group(db_url)
        took = time.monotonic() - began
        pid = holder.info.backend_pid
        holder.rollback()
    assert took < 20, took
    assert str(raised.value).startswith(f"a read waited 0.5s for a lock held elsewhere and gave up (locks held by "
                                        f"pid {pid} ("), raised.value
    assert "long-alter" in str(raised.value) and "wait longer with COMPOSER_LOCK_WAIT" in str(raised.value)


def test_a_lock_timeout_that_is_not_of_its_reads_is_left_as_raised(db_url: str) -> None:
    with pytest.raises(LockTimeout, match="^the engine's own lock wait$"):
        with ops.snapshot(db_url) as conn:
            ops.db_now(conn)
            raise LockTimeout("the engine's own lock wait")
