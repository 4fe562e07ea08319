"""Retry a whole transaction on transient database errors.

:class:`~composer_ops.errors.Transient` errors (serialization failures, deadlocks,
lock timeouts, lost connections, a server restarting) are retried with jittered,
capped exponential backoff; anything else propagates at once. The decorated function
must be the whole transaction: a retry re-runs it from its first statement.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from composer_ops.errors import Transient

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


def backoff_delay(attempt: int, *, base: float = 0.05, cap: float = 2.0, rng: random.Random | None = None) -> float:
    """Full-jitter delay before retry number ``attempt`` (0-based)."""
    return (rng or random).uniform(0, min(cap, base * (2**attempt)))


#: The calls in all, by default, of a function :func:`db_retry` decorates.
DEFAULT_ATTEMPTS = 6


def db_retry(
    max_attempts: int = DEFAULT_ATTEMPTS, *, base: float = 0.05, cap: float = 2.0,
    give_up: tuple[type[Transient], ...] = (),
) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Decorator: call again when the function raises :class:`Transient`, up to
    ``max_attempts`` calls in all; the last error propagates. The kinds of Transient in
    ``give_up`` propagate at once: their caller has something better to do than wait
    again (a coordinator whose event found its run's lock held moves on to the next)."""

    def wrap(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> T:
            attempt = 0
            while True:
                try:
                    return fn(*args, **kwargs)
                except Transient as exc:
                    if attempt + 1 >= max_attempts or isinstance(exc, give_up):
                        raise
                    delay = backoff_delay(attempt, base=base, cap=cap)
                    log.warning("transient database error in %s (%s); retry %d in %.2fs",
                                fn.__qualname__, type(exc.__cause__ or exc).__name__, attempt + 1, delay)
                    time.sleep(delay)
                    attempt += 1

        return inner

    return wrap
