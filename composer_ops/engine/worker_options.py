"""The settings of a :class:`~composer_ops.engine.worker.Worker` that the CLI checks too
(``composer-ops worker``): each check raises :class:`~composer_ops.errors.Invalid` in one line."""

from __future__ import annotations

import math

from composer_ops.errors import Invalid

#: The most tasks a worker may hold beyond its slots (``prefetch``): each held task is
#: heartbeated as a running one.
MAX_PREFETCH = 100

#: How long ``composer-ops worker`` and ``coordinator`` wait, by default, on SIGTERM.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def check_shutdown_timeout(value: float | None) -> None:
    """``None`` (wait for handlers as long as they take) or a finite number of seconds >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise Invalid(f"shutdown timeout must be a number of seconds >= 0, got {value!r}")


def check_prefetch(value: object) -> None:
    """A whole number of tasks from 0 (claim for free slots only) to :data:`MAX_PREFETCH`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PREFETCH:
        raise Invalid(f"prefetch must be a whole number of tasks from 0 to {MAX_PREFETCH}, got {value!r}")


def check_concurrency(value: object) -> None:
    """A whole number of slots, at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Invalid(f"concurrency must be an integer of at least 1, got {value!r}")


def check_seconds(what: str, value: object, *, most: float = math.inf) -> None:
    """A number of seconds above 0 (and at most ``most``), for ``what`` (e.g. "poll interval")."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= most:
        bound = "" if math.isinf(most) else f" and at most {most:g}"
        raise Invalid(f"{what} must be a number of seconds above 0{bound}, got {value!r}")
