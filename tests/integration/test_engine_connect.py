"""``Engine.connect``'s arguments and the engine's life: what is refused as bad input,
how long a call waits for a server that went away, and a call after ``close()``."""

from __future__ import annotations

import time

import pytest

from composer_ops import ComposerError, Engine, Invalid, Transient, Unavailable
from composer_ops.engine.ids import uuid7_text
from composer_ops.testing.faultproxy import FaultProxy


@pytest.mark.parametrize("size", [0, -1, "3", 1.5, True])
def test_a_pool_size_that_is_not_a_positive_integer_is_invalid(size: object) -> None:
    with pytest.raises(Invalid, match=r"^pool_size must be a positive integer, got "):
        Engine.connect("postgresql://nobody@/nowhere?host=/nonexistent", pool_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["abc", "0", "-2", "1.5", ""])
def test_a_bad_composer_pool_size_is_invalid(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPOSER_POOL_SIZE", text)
    with pytest.raises(Invalid, match=r"^COMPOSER_POOL_SIZE must be a positive integer, got "):
        Engine.connect("postgresql://nobody@/nowhere?host=/nonexistent")


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), "5"])
def test_a_timeout_that_is_not_a_positive_number_is_invalid(timeout: object) -> None:
    with pytest.raises(Invalid, match=r"^timeout_s must be a positive number of seconds"):
        Engine.connect("postgresql://nobody@/nowhere?host=/nonexistent", timeout_s=timeout)  # type: ignore[arg-type]


def test_a_url_libpq_cannot_parse_is_invalid_not_unavailable() -> None:
    with pytest.raises(Invalid, match="is not a libpq URL") as raised:
        Engine.connect("not a url secretpassword")
    assert "secretpassword" not in str(raised.value)


def test_a_call_after_close_is_a_plain_error_not_unavailable(db_url: str) -> None:
    engine = Engine.connect(db_url, pool_size=1)
    engine.close()
    with pytest.raises(ComposerError, match="closed by this process") as raised:
        engine.get_run(uuid7_text())
    assert not isinstance(raised.value, Unavailable)


def test_a_call_on_a_server_gone_away_fails_within_the_timeout(db_url: str) -> None:
    proxy = FaultProxy(db_url)
    closed = False
    try:
        with Engine.connect(proxy.url(), pool_size=2, timeout_s=3.0) as engine:
            engine.list_partitions()           # connected, and a connection in the pool
            proxy.close()                      # the server is unreachable from now on
            closed = True
            started = time.monotonic()
            with pytest.raises(Transient):
                engine.list_partitions()
            took = time.monotonic() - started
        # 3 s of waits for a connection plus under 2 s of backoff (with the pool's fixed
        # 30 s a wait, about 180 s); slack for a loaded machine
        assert took < 8.0, took
    finally:
        if not closed:
            proxy.close()
