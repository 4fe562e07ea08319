"""Refused input, as the unit tests see it: one :class:`Invalid` of one line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from composer_ops.errors import Invalid


def refusal(call: Callable[..., object], *args: Any, **kwargs: Any) -> str:
    """The message of the :class:`Invalid` that ``call(*args, **kwargs)`` raises,
    checked to be one line (the CLI and the notebooks show it as it is)."""
    with pytest.raises(Invalid) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message, repr(message)
    return message
