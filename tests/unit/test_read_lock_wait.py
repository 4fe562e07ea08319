"""How long the ops' reads wait for a lock held elsewhere: ``COMPOSER_LOCK_WAIT``."""

from __future__ import annotations

import pytest

from composer_ops.errors import Invalid
from composer_ops.ops._common import READ_LOCK_WAIT_S, read_lock_wait_s


@pytest.mark.parametrize(("raw", "seconds"), [(None, READ_LOCK_WAIT_S), ("", READ_LOCK_WAIT_S), ("2.5", 2.5),
                                              (" 90 ", 90.0)])
def test_the_wait_is_the_variable_or_the_default(monkeypatch: pytest.MonkeyPatch, raw: str | None,
                                                 seconds: float) -> None:
    if raw is None:
        monkeypatch.delenv("COMPOSER_LOCK_WAIT", raising=False)
    else:
        monkeypatch.setenv("COMPOSER_LOCK_WAIT", raw)
    assert read_lock_wait_s() == seconds


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "-inf", "soon"])
def test_a_wait_that_is_not_seconds_above_0_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                                           raw: str) -> None:
    monkeypatch.setenv("COMPOSER_LOCK_WAIT", raw)
    with pytest.raises(Invalid, match=f"COMPOSER_LOCK_WAIT must be a finite number of seconds above 0, got '{raw}'"):
        read_lock_wait_s()
