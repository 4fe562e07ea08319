"""Hypothesis settings for the fuzz suites, and the session's tally of cases tried.

``COMPOSER_FUZZ_SCALE`` multiplies every suite's example count (default 1: about
25 s in all on 2 cores). Runs are derandomized so CI is repeatable; set
``COMPOSER_FUZZ_RANDOM=1`` to explore other cases (with ``--hypothesis-seed``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.fuzz.strategies import CASES

SCALE = float(os.environ.get("COMPOSER_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("COMPOSER_FUZZ_RANDOM") == "1"

settings.register_profile(
    "composer-fuzz", deadline=None, derandomize=not RANDOM, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture])


def examples(n: int) -> settings:
    """The profile with ``n`` examples (times COMPOSER_FUZZ_SCALE)."""
    return settings(settings.get_profile("composer-fuzz"), max_examples=max(1, int(n * SCALE)))


@pytest.fixture(scope="session", autouse=True)
def fuzz_summary(request: pytest.FixtureRequest) -> Iterator[None]:
    """Write the tally to .pytest_cache/composer-fuzz.json when the session ends."""
    yield
    if CASES:
        path = Path(str(request.config.rootpath)) / ".pytest_cache" / "composer-fuzz.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"total": sum(CASES.values()), "suites": dict(sorted(CASES.items()))}, indent=2))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if CASES:
        terminalreporter.write_sep("-", f"fuzz: {sum(CASES.values())} cases tried")
        for suite, n in sorted(CASES.items()):
            terminalreporter.write_line(f"  {suite:<46} {n:>6}")
