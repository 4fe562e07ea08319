"""Retry policy: a pure function from the failed attempt to a delay or "give up".

Kept free of clocks and randomness so the state machine stays deterministic: the
caller turns the delay into an ``available_at`` with the database clock, and
passes jitter explicitly when it wants any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from composer_ops.errors import Invalid

__all__ = ["DEFAULT_RETRY", "RetryPolicy", "retry_decision"]


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently a TASK node is retried.

    ``max_attempts`` counts every attempt, the first included: 1 means no retry.
    The delay before retry ``n`` (0-based) is
    ``min(initial_backoff_s * multiplier ** n, max_backoff_s)``.
    """

    max_attempts: int = 1
    initial_backoff_s: float = 1
    multiplier: float = 2
    max_backoff_s: float = 60

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise Invalid(f"retry.max_attempts must be an integer, got {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise Invalid(f"retry.max_attempts must be at least 1, got {self.max_attempts}")
        for name in ("initial_backoff_s", "multiplier", "max_backoff_s"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise Invalid(f"retry.{name} must be a finite number, got {value!r}")
        if self.initial_backoff_s < 0:
            raise Invalid(f"retry.initial_backoff_s must not be negative, got {self.initial_backoff_s}")
        if self.multiplier < 1:
            raise Invalid(f"retry.multiplier must be at least 1, got {self.multiplier}")
        if self.max_backoff_s < self.initial_backoff_s:
            raise Invalid(
                f"retry.max_backoff_s ({self.max_backoff_s}) must not be less than "
                f"retry.initial_backoff_s ({self.initial_backoff_s})"
            )


DEFAULT_RETRY = RetryPolicy()


def retry_decision(policy: RetryPolicy, attempt: int, retryable: bool, *, jitter: float = 0.0) -> float | None:
    """Seconds to wait before the next attempt, or ``None`` to give up.

    ``attempt`` is the 0-based attempt that just failed. Gives up when the error is
    not retryable or when ``attempt + 1`` attempts have used up ``max_attempts``.
    ``jitter`` in ``[0, 1)`` shortens the delay by that fraction, so a caller that
    draws it at random spreads retries without ever exceeding ``max_backoff_s``.
    """
    if attempt < 0:
        raise ValueError(f"attempt must not be negative, got {attempt}")
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    if not retryable or attempt + 1 >= policy.max_attempts:
        return None
    # Compare in log space first: multiplier ** attempt overflows a float long before
    # attempt reaches the range an int allows.
    if policy.initial_backoff_s == 0:
        delay = 0.0
    elif attempt * math.log(policy.multiplier) >= math.log(policy.max_backoff_s / policy.initial_backoff_s):
        delay = policy.max_backoff_s
    else:
        delay = min(policy.initial_backoff_s * policy.multiplier**attempt, policy.max_backoff_s)
    return delay * (1.0 - jitter)
