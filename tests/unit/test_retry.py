"""Retry policy: attempts are 0-based, the delay grows and is capped."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from composer_ops.core.retry import DEFAULT_RETRY, RetryPolicy, retry_decision
from composer_ops.errors import Invalid

POLICY = RetryPolicy(max_attempts=5, initial_backoff_s=1, multiplier=2, max_backoff_s=5)


def test_default_never_retries() -> None:
    assert DEFAULT_RETRY.max_attempts == 1
    assert retry_decision(DEFAULT_RETRY, 0, True) is None


@pytest.mark.parametrize(("attempt", "delay"), [(0, 1), (1, 2), (2, 4), (3, 5)])
def test_backoff_grows_and_caps(attempt: int, delay: float) -> None:
    assert retry_decision(POLICY, attempt, True) == delay


def test_gives_up_after_max_attempts() -> None:
    assert retry_decision(POLICY, 4, True) is None
    assert retry_decision(POLICY, 10, True) is None


def test_not_retryable_gives_up_at_once() -> None:
    assert retry_decision(POLICY, 0, False) is None


def test_huge_attempt_does_not_overflow() -> None:
    policy = RetryPolicy(max_attempts=10**9, initial_backoff_s=1, multiplier=10, max_backoff_s=60)
    assert retry_decision(policy, 10**6, True) == 60


def test_zero_backoff_and_constant_backoff() -> None:
    assert retry_decision(RetryPolicy(max_attempts=3, initial_backoff_s=0, max_backoff_s=0), 1, True) == 0
    constant = RetryPolicy(max_attempts=9, initial_backoff_s=3, multiplier=1, max_backoff_s=10)
    assert [retry_decision(constant, a, True) for a in range(4)] == [3, 3, 3, 3]


def test_jitter_shortens_but_never_lengthens() -> None:
    assert retry_decision(POLICY, 1, True, jitter=0.5) == 1
    with pytest.raises(ValueError):
        retry_decision(POLICY, 1, True, jitter=1.0)
    with pytest.raises(ValueError):
        retry_decision(POLICY, -1, True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": True},
        {"initial_backoff_s": -1},
        {"multiplier": 0.9},
        {"initial_backoff_s": 10, "max_backoff_s": 1},
        {"max_backoff_s": float("inf")},
    ],
)
def test_policy_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(Invalid, match="retry"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


@given(
    max_attempts=st.integers(1, 20),
    initial=st.floats(0, 100),
    multiplier=st.floats(1, 10),
    extra=st.floats(0, 1000),
    attempt=st.integers(0, 30),
    jitter=st.floats(0, 0.999),
)
def test_delay_properties(
    max_attempts: int, initial: float, multiplier: float, extra: float, attempt: int, jitter: float
) -> None:
    policy = RetryPolicy(
        max_attempts=max_attempts, initial_backoff_s=initial, multiplier=multiplier, max_backoff_s=initial + extra
    )
    delay = retry_decision(policy, attempt, True, jitter=jitter)
    if attempt + 1 >= max_attempts:
        assert delay is None
    else:
        assert delay is not None
        assert 0 <= delay <= policy.max_backoff_s
        plain = retry_decision(policy, attempt, True)
        assert plain is not None
        assert plain == pytest.approx(min(initial * multiplier**attempt, policy.max_backoff_s))
        if attempt + 2 < max_attempts:
            following = retry_decision(policy, attempt + 1, True)
            assert following is not None and following >= plain
