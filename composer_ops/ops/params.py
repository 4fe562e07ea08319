"""The report notebooks' parameters, checked in one place.

``composer-ops report`` checks ``-p`` values here before a kernel starts (a bad one
exits 2 and writes nothing), and each notebook checks its parameters again with
the same function (a notebook run by hand or by papermill directly gets the same
one-line error).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from composer_ops.errors import Invalid

Check = Callable[[str, Any], Any]


def _int_between(low: int, high: int) -> Check:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise Invalid(f"must be an integer from {low} to {high}, got {value!r}")
        return value
    return check


#: The checks of parameters that take any number (an integer default too).
_NUMBERS: list[Check] = []

#: The largest duration a number parameter or a ``check`` threshold may give, per unit
#: (its name's suffix, ``_s`` or ``_h``): 100 years. The reads turn them into intervals
#: counted back from the database clock, which overflow (or leave PostgreSQL's range of
#: timestamps) far above it; ``inf`` would fail there, or when the value is printed.
MOST = {"s": 100 * 365.25 * 86400, "h": 100 * 365.25 * 24}


def number(value: Any, *, low: float = 0, inclusive: bool = True, unit: str = "s") -> float:
    """``value`` as a float when it is a finite number above ``low`` and at most
    :data:`MOST` of ``unit``; else :class:`Invalid` saying so ("must be a number ...").
    The one check of the notebooks' number parameters and of ``check``'s thresholds."""
    most = MOST[unit]
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            value >= low if inclusive else value > low):
        raise Invalid(f"must be a number {'>=' if inclusive else '>'} {low:g}, got {value!r}")
    if not math.isfinite(value) or value > most:
        raise Invalid(f"must be a finite number of at most {most:.10g} (100 years in "
                      f"{'seconds' if unit == 's' else 'hours'}), got {value!r}")
    return float(value)


def _number_above(low: float, *, inclusive: bool, unit: str = "s") -> Check:
    def check(name: str, value: Any) -> float:
        return number(value, low=low, inclusive=inclusive, unit=unit)
    _NUMBERS.append(check)
    return check


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"must be true or false, got {value!r}")
    return value


def _cutoff(name: str, value: Any) -> Any:
    from composer_ops.core.cutoff import parse_cutoff

    return parse_cutoff(value if isinstance(value, str) else "")


def _run_id(name: str, value: Any) -> str | None:
    if value is None:
        return None
    from composer_ops.ops.investigation import validate_run_id

    return validate_run_id(value)


def _where(name: str, value: Any) -> Any:
    if value is None:
        return None
    from composer_ops.core.filters import parse_where

    if not isinstance(value, str):
        raise Invalid(f"must be conditions on the input like input.customer=42, or None, got {value!r}")
    return parse_where(value, option="value")


def _directory(name: str, value: Any) -> str | None:
    """An existing directory, as an absolute path: a kernel runs in the notebooks' folder,
    where a relative path would name another directory (or none)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise Invalid(f"must be a directory path or None, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise Invalid(f"{value}: no such directory" if not path.exists() else f"{value}: not a directory")
    return str(path.resolve())


def _url(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise Invalid(f"must be a libpq URL or None, got {value!r}")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 1000:
        raise Invalid(f"must be non-empty text of at most 1000 characters, got {value!r}")
    return value


def _run_ids(name: str, value: Any) -> list[str]:
    from composer_ops.ops.investigation import validate_run_id

    if not isinstance(value, list) or len(value) > 100:
        raise Invalid(f"must be a JSON list of at most 100 run IDs, got {value!r}")
    return [validate_run_id(str(v)) for v in value]


def _schedule_names(name: str, value: Any) -> list[str]:
    from composer_ops.core.schedules import check_name

    if not isinstance(value, list) or len(value) > 100:
        raise Invalid(f"must be a JSON list of at most 100 schedule names, got {value!r}")
    return [check_name(v) for v in value]


def _selection(name: str, value: Any) -> Any:
    """``workflow``, ``since`` or ``where`` of a selection of runs, as ``runs list`` checks it."""
    if value is None:
        return None
    from composer_ops.core.selection import selection

    selection(**{name: value})
    return value


def _queue(name: str, value: Any) -> str | None:
    if value is None:
        return None
    from composer_ops.engine.queues import check_queue

    return check_queue(value)


def _queue_action(name: str, value: Any) -> str:
    if value not in ("pause", "resume", "set-limit"):
        raise Invalid(f"must be pause, resume or set-limit, got {value!r}")
    return str(value)


def _reason(name: str, value: Any) -> str:
    if not isinstance(value, str) or len(value) > 1000:
        raise Invalid(f"must be text of at most 1000 characters, got {value!r}")
    return value


def _node(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise Invalid(f"must be a node id or None, got {value!r}")
    return value


#: The runbooks' parameters (notebooks/runbooks/), checked like the reports'.
RUNBOOK_CHECKS: dict[str, dict[str, Check]] = {
    "replay_lag": {"replay_lag_s": _number_above(0, inclusive=True)},
    "partitions_ahead": {"months_ahead_min": _int_between(0, 120), "months_ahead": _int_between(0, 120)},
    "sweeper_lag": {"sweeper_lag_s": _number_above(0, inclusive=True)},
    "timers_overdue": {"timers_overdue_s": _number_above(0, inclusive=True), "limit": _int_between(1, 1000)},
    "outbox_ready": {"outbox_ready_age_s": _number_above(0, inclusive=True),
                     "workers_window_h": _number_above(0, inclusive=True, unit="h")},
    "retention_blocked": {"cutoff": _cutoff, "reason": _text},
    "long_waits": {"long_wait_h": _number_above(0, inclusive=True, unit="h"), "cancel_runs": _run_ids,
                   "reason": _text},
    "failing_webhooks": {"webhook_attempts": _int_between(1, 1000), "limit": _int_between(1, 1000)},
    "schedule_late": {"schedule_late_s": _number_above(0, inclusive=True), "trigger": _schedule_names},
    "dead_worker": {"workers_window_h": _number_above(0, inclusive=True, unit="h")},
    "replay_failed": {"workflow": _selection, "since": _selection, "where": _selection, "from_node": _node,
                      "limit": _int_between(1, 1000)},
    "downstream_overloaded": {"queue": _queue, "action": _queue_action, "reason": _reason,
                              "max_running": _int_between(0, 1_000_000),
                              "queue_paused_h": _number_above(0, inclusive=True, unit="h")},
    "find_run": {"workflow": _selection, "since": _selection, "where": _selection, "limit": _int_between(1, 1000)},
}
for _checks in RUNBOOK_CHECKS.values():
    _checks["confirm"] = _boolean

#: Per notebook, each parameter's check (the notebooks' parameters cells declare them).
CHECKS: dict[str, dict[str, Check]] = {
    "active_tasks": {"top_n": _int_between(1, 1000), "oldest_limit": _int_between(1, 1000),
                     "long_wait_h": _number_above(0, inclusive=True, unit="h")},
    "lease_expiries": {"requeue_window_s": _number_above(0, inclusive=False),
                       "requeue_limit": _int_between(1, 1000),
                       "workers_window_h": _number_above(0, inclusive=True, unit="h")},
    "partition_sizes": {"months_ahead_min": _int_between(0, 120), "exact_rows": _boolean,
                        "projection_months": _int_between(0, 60)},
    "retention_dry_run": {"cutoff": _cutoff, "exact_rows": _boolean},
    "run_investigation": {"run_id": _run_id, "where": _where, "archive_dir": _directory},
    **RUNBOOK_CHECKS,
}


def takes_number(notebook: str, name: str) -> bool:
    """Whether parameter ``name`` of ``notebook`` takes any number (``-p sweeper_lag_s
    1.5``), whatever the type of its default."""
    return any(check is CHECKS.get(notebook, {}).get(name) for check in _NUMBERS)


def absolute_paths(notebook: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each directory parameter of ``notebook`` as the absolute path its
    check makes of it (what a caller outside the kernel gives one it starts)."""
    checks = CHECKS.get(notebook, {})
    return {name: _directory(name, value) if checks.get(name) is _directory else value
            for name, value in values.items()}


def check_parameters(notebook: str, /, **values: Any) -> dict[str, Any]:
    """``values`` checked for ``notebook`` (:class:`Invalid` "name: problem" for the first bad one);
    returns them, with a cut-off parsed and a run ID in canonical form. Parameters
    without a check (``database_url``, or a notebook this module does not know) are
    returned as they are."""
    checks: Mapping[str, Check] = {"database_url": _url, **CHECKS.get(notebook, {})}
    out = {}
    for name, value in values.items():
        try:
            out[name] = checks[name](name, value) if name in checks else value
        except Invalid as exc:
            raise Invalid(f"{name}: {exc}") from None
    return out
