"""The behaviour model shared by live traffic and the generated months.

A live handler and the backfill draw the same quantities from the same functions,
seeded per run, node and attempt: lognormal durations per task name (times
``time_scale``), transient and permanent failures per attempt at ``transient_rate`` and
``permanent_rate`` weighted per task, and, for the backfill only, ``crash_rate``, the
share of attempts whose worker dies (live traffic kills real processes instead).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from composer_ops.errors import Invalid, NonRetryableError

__all__ = [
    "PROFILES",
    "AttemptDraw",
    "Behaviour",
    "Profile",
    "attempt_rng",
    "draw_attempt",
    "raise_failure",
    "task_output",
]


class UpstreamUnavailable(ConnectionError):
    """A dependency answered 5xx or refused the connection (retryable)."""


class RateLimited(Exception):
    """A dependency asked us to slow down (retryable)."""


#: Exception classes the live handlers raise, by the name the worker records.
ERROR_TYPES: Mapping[str, type[Exception]] = {
    "TimeoutError": TimeoutError,
    "ConnectionResetError": ConnectionResetError,
    "UpstreamUnavailable": UpstreamUnavailable,
    "RateLimited": RateLimited,
    "NonRetryableError": NonRetryableError,
}

_TRANSIENT: tuple[tuple[str, str], ...] = (
    ("TimeoutError", "upstream did not answer within 5s"),
    ("ConnectionResetError", "connection reset by peer"),
    ("UpstreamUnavailable", "HTTP 503 Service Unavailable"),
    ("RateLimited", "HTTP 429 Too Many Requests (retry after 2s)"),
)
_PERMANENT: Mapping[str, tuple[str, ...]] = {
    "payments": ("card declined: do_not_honor", "card declined: insufficient_funds", "currency not supported"),
    "risk": ("customer record missing",),
    "ship": ("address validation failed: unknown postcode", "parcel exceeds carrier weight limit"),
    "notify": ("recipient address bounced permanently",),
    "batch": ("schema mismatch in shard input", "source file truncated"),
    "approvals": ("employee not found in HR directory",),
    "billing": ("invoice already voided",),
}


@dataclass(frozen=True, kw_only=True)
class Profile:
    """How one task name behaves: lognormal duration, failure weights."""

    median_s: float
    sigma: float
    transient_weight: float = 1.0
    permanent_weight: float = 1.0


PROFILES: Mapping[str, Profile] = {
    "payments.charge": Profile(median_s=0.35, sigma=0.6, transient_weight=1.6, permanent_weight=2.0),
    "payments.payout": Profile(median_s=0.6, sigma=0.6, transient_weight=1.4),
    "risk.score": Profile(median_s=0.2, sigma=0.5, transient_weight=1.0, permanent_weight=1.5),
    "ship.express": Profile(median_s=0.5, sigma=0.5, transient_weight=1.2),
    "ship.standard": Profile(median_s=0.9, sigma=0.7, transient_weight=1.2),
    "notify.email": Profile(median_s=0.12, sigma=0.6, transient_weight=0.6, permanent_weight=0.5),
    "batch.extract": Profile(median_s=2.0, sigma=0.4, transient_weight=0.8),
    "batch.transform": Profile(median_s=1.2, sigma=0.9, transient_weight=1.0),
    "batch.merge": Profile(median_s=1.5, sigma=0.3, transient_weight=0.5, permanent_weight=0.5),
    "batch.publish": Profile(median_s=0.4, sigma=0.5, transient_weight=0.8, permanent_weight=0.3),
    "approvals.submit": Profile(median_s=0.25, sigma=0.5, transient_weight=0.5),
    "approvals.archive": Profile(median_s=0.15, sigma=0.4, transient_weight=0.3, permanent_weight=0.2),
    "billing.invoice": Profile(median_s=0.3, sigma=0.5),
    "billing.check": Profile(median_s=0.2, sigma=0.5, transient_weight=0.8, permanent_weight=0.3),
    "billing.close": Profile(median_s=0.1, sigma=0.4, transient_weight=0.5, permanent_weight=0.2),
}

_ENV = {
    "transient_rate": "COMPOSER_SIM_TRANSIENT_RATE",
    "permanent_rate": "COMPOSER_SIM_PERMANENT_RATE",
    "crash_rate": "COMPOSER_SIM_CRASH_RATE",
    "time_scale": "COMPOSER_SIM_TIME_SCALE",
}


@dataclass(frozen=True, kw_only=True)
class Behaviour:
    """Rates and scale of the simulated world; validated on construction."""

    transient_rate: float = 0.05
    permanent_rate: float = 0.01
    crash_rate: float = 0.003
    time_scale: float = 1.0
    #: No single attempt runs longer than this many (scaled) seconds.
    max_task_s: float = 12.0

    def __post_init__(self) -> None:
        for name in ("transient_rate", "permanent_rate", "crash_rate"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0.0 <= value < 1.0):
                raise Invalid(f"--{name.replace('_', '-')} must be a fraction in [0, 1), got {value!r}")
        if self.transient_rate + self.permanent_rate >= 1.0:
            raise Invalid("--transient-rate plus --permanent-rate must stay below 1")
        if not (math.isfinite(self.time_scale) and 0.01 <= self.time_scale <= 100):
            raise Invalid(f"--time-scale must be between 0.01 and 100, got {self.time_scale!r}")

    def to_env(self) -> dict[str, str]:
        """The environment that gives a worker process this behaviour."""
        return {env: repr(getattr(self, name)) for name, env in _ENV.items()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Behaviour:
        source = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for name, env in _ENV.items():
            if env in source:
                try:
                    values[name] = float(source[env])
                except ValueError:
                    raise Invalid(f"{env}={source[env]!r} is not a number") from None
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class AttemptDraw:
    """One attempt's fate: how long it runs and how it ends."""

    duration_s: float
    outcome: str                  # "ok" | "transient" | "permanent"
    error_type: str | None = None
    message: str | None = None

    @property
    def error_text(self) -> str | None:
        """The error as the worker records it (``Type: message``)."""
        return None if self.error_type is None else f"{self.error_type}: {self.message}"


def attempt_rng(seed: int, run_key: str, node_id: str, attempt: int, retry: int = 0) -> random.Random:
    """The random stream of one attempt: the same seed replays the same behaviour. An
    operator's retry runs a node again from attempt 0, so ``retry`` (the run's retries
    so far) is part of the seed: a retried run draws afresh and may succeed."""
    again = f":retry{retry}" if retry else ""
    return random.Random(f"composer-sim:{seed}:{run_key}:{node_id}:{attempt}{again}")


def draw_attempt(rng: random.Random, behaviour: Behaviour, task: str) -> AttemptDraw:
    """Duration and outcome of one attempt of ``task``."""
    profile = PROFILES.get(task) or Profile(median_s=0.3, sigma=0.5)
    duration = min(rng.lognormvariate(math.log(profile.median_s), profile.sigma), behaviour.max_task_s)
    duration *= behaviour.time_scale
    roll = rng.random()
    transient = behaviour.transient_rate * profile.transient_weight
    permanent = behaviour.permanent_rate * profile.permanent_weight
    if roll < permanent:
        family = task.split(".", 1)[0]
        message = rng.choice(_PERMANENT.get(family, ("invalid request",)))
        return AttemptDraw(duration_s=duration, outcome="permanent", error_type="NonRetryableError",
                           message=message)
    if roll < permanent + transient:
        error_type, message = rng.choice(_TRANSIENT)
        # A timeout takes as long as the timeout; other failures come early.
        return AttemptDraw(duration_s=duration if error_type == "TimeoutError" else duration * 0.3,
                           outcome="transient", error_type=error_type, message=message)
    return AttemptDraw(duration_s=duration, outcome="ok")


def raise_failure(draw: AttemptDraw) -> None:
    """Raise the exception a live handler raises for a failed draw."""
    if draw.outcome == "ok" or draw.error_type is None:
        return
    raise ERROR_TYPES[draw.error_type](draw.message)


def _ref(rng: random.Random, prefix: str, digits: int = 8) -> str:
    return f"{prefix}{rng.getrandbits(40) % 10**digits:0{digits}d}"


def task_output(task: str, input: Any, rng: random.Random) -> Any:
    """What a successful attempt of ``task`` returns for ``input``."""
    data: Mapping[str, Any] = input if isinstance(input, dict) else {}
    if task == "payments.charge":
        amount = data.get("amount") or 0
        return {"charged": amount, "currency": data.get("currency"), "auth_code": _ref(rng, "A", 6),
                "tier": "gold" if isinstance(amount, int | float) and amount >= 200 else "standard"}
    if task == "payments.payout":
        return {"paid": data.get("amount"), "transfer": _ref(rng, "TR")}
    if task == "risk.score":
        return {"score": round(rng.betavariate(1.2, 8.0), 3)}
    if task in ("ship.express", "ship.standard"):
        carrier = "courier" if task == "ship.express" else rng.choice(("post", "dpd", "gls"))
        return {"carrier": carrier, "tracking": _ref(rng, "TRK", 10)}
    if task == "notify.email":
        return {"sent": True, "template": data.get("template", "generic")}
    if task == "batch.extract":
        return {"rows": rng.randint(50_000, 400_000), "partitions": data.get("shards")}
    if task == "batch.transform":
        return {"shard": data.get("shard"), "rows": rng.randint(5_000, 80_000)}
    if task == "batch.merge":
        return {"rows": rng.randint(100_000, 500_000), "files": rng.randint(4, 12)}
    if task == "batch.publish":
        return {"published": True, "dataset": f"warehouse.daily_{data.get('date', 'unknown')}"}
    if task == "approvals.submit":
        return {"request_id": _ref(rng, "EXP-", 6), "amount": data.get("amount")}
    if task == "approvals.archive":
        return {"archived": True}
    if task == "billing.invoice":
        return {"invoice": _ref(rng, "INV-", 7), "amount": data.get("amount")}
    if task == "billing.check":
        return {"status": "paid" if rng.random() < 0.7 else "unpaid"}
    if task == "billing.close":
        return {"closed": True}
    return {"ok": True}
