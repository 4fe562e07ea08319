"""Flow control on a TASK node: priority, timeouts, a concurrency key and a rate limit.

Pure: :func:`parse_flow` validates the four keys of a node (SPEC.md section 5, "Flow
control on a TASK node") and returns a :class:`FlowControl`, or raises ``Invalid`` with
one line naming the node. The key expressions are ``$.`` references (``$.input...``,
``$.config...``, ``$.nodes.<id>.output...``); ``core.spec`` checks that a referenced
node is upstream, like an input reference. A node with none of the keys has
``FlowControl()`` (:data:`NO_FLOW`), whose canonical document is empty: definitions
without flow control keep the canonical form they always had.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from composer_ops.core.expressions import is_ref, parse_ref
from composer_ops.errors import Invalid

__all__ = ["FLOW_KEYS", "NO_FLOW", "Concurrency", "FlowControl", "RateLimit", "Timeouts", "flow_refs", "key_text",
           "parse_flow", "slot_is_free"]

#: The node keys this module owns.
FLOW_KEYS = frozenset({"priority", "timeouts", "concurrency", "rate_limit"})
#: Priorities fit a PostgreSQL SMALLINT; higher is claimed first within a queue.
MIN_PRIORITY, MAX_PRIORITY = -32768, 32767
_TIMEOUT_KEYS = ("schedule_to_start_s", "start_to_close_s")
#: A timeout of at most 30 days: a task waiting longer to start is a backlog, not a timeout.
MAX_TIMEOUT_S = 30 * 86_400
MAX_CONCURRENCY = 1_000_000
MAX_RATE = 1_000_000.0
MAX_BURST = 1_000_000
#: A rate limit's literal name: the queue-name alphabet.
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    schedule_to_start_s: float | None = None
    start_to_close_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Concurrency:
    key: str            # a $. reference, resolved when the task is created
    limit: int


@dataclass(frozen=True, kw_only=True)
class RateLimit:
    key: str            # a literal name shared by every node that names it, or a $. reference
    per_s: float
    burst: int

    @property
    def key_is_ref(self) -> bool:
        return is_ref(self.key)


@dataclass(frozen=True, kw_only=True)
class FlowControl:
    priority: int = 0
    timeouts: Timeouts = Timeouts()
    concurrency: Concurrency | None = None
    rate_limit: RateLimit | None = None

    def to_json(self) -> dict[str, Any]:
        """The canonical keys of the node document: only those that are set."""
        doc: dict[str, Any] = {}
        if self.priority:
            doc["priority"] = self.priority
        timeouts = {k: getattr(self.timeouts, k) for k in _TIMEOUT_KEYS if getattr(self.timeouts, k) is not None}
        if timeouts:
            doc["timeouts"] = timeouts
        if self.concurrency is not None:
            doc["concurrency"] = {"key": self.concurrency.key, "limit": self.concurrency.limit}
        if self.rate_limit is not None:
            doc["rate_limit"] = {"key": self.rate_limit.key, "per_s": self.rate_limit.per_s,
                                 "burst": self.rate_limit.burst}
        return doc


NO_FLOW = FlowControl()


def _q(value: object) -> str:
    if isinstance(value, str):
        text = json.dumps(value)
    else:
        try:
            text = repr(value)
        except ValueError:
            return f"<{type(value).__name__} too large to print>"
    return text if len(text) <= 80 else text[:77] + "..."


def _object(value: Any, where: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"{where} must be an object, got {_q(value)}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise Invalid(f"{where}: unknown key {_q(unknown[0])} (allowed: {', '.join(allowed)})")
    return value


def _integer(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Invalid(f"{where} must be an integer from {low} to {high}, got {_q(value)}")
    return value


def _positive(value: Any, where: str, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Invalid(f"{where} must be a finite number, got {_q(value)}")
    if not 0 < value <= high:
        raise Invalid(f"{where} must be greater than 0 and at most {high:g}, got {value}")
    return value


def _key_ref(value: Any, where: str) -> str:
    if not is_ref(value):
        raise Invalid(f"{where} must be a $. reference ($.input..., $.config... or $.nodes.<id>.output...), "
                      f"got {_q(value)}")
    try:
        parse_ref(value)
    except Invalid as exc:
        raise Invalid(f"{where}: {exc}") from None
    return str(value)


def _rate_key(value: Any, where: str) -> str:
    if is_ref(value):
        return _key_ref(value, where)
    if not isinstance(value, str) or not 1 <= len(value) <= 128 or not set(value) <= _NAME_CHARS:
        raise Invalid(f"{where} must be a name of 1 to 128 of A-Z a-z 0-9 _ . - or a $. reference, got {_q(value)}")
    return value


def parse_flow(raw: Mapping[str, Any], where: str) -> FlowControl:
    """The flow control of a TASK node document ``raw`` (its other keys are ignored);
    ``where`` names the node in errors (``node "charge"``)."""
    if not FLOW_KEYS & raw.keys():
        return NO_FLOW
    priority = _integer(raw["priority"], f"{where}: priority", MIN_PRIORITY, MAX_PRIORITY) \
        if "priority" in raw else 0
    timeouts = Timeouts()
    if "timeouts" in raw:
        doc = _object(raw["timeouts"], f"{where}: timeouts", _TIMEOUT_KEYS)
        if not doc:
            raise Invalid(f"{where}: timeouts must name at least one of {', '.join(_TIMEOUT_KEYS)}")
        timeouts = Timeouts(**{k: _positive(doc[k], f"{where}: timeouts.{k}", MAX_TIMEOUT_S)
                               for k in _TIMEOUT_KEYS if k in doc})
    concurrency = None
    if "concurrency" in raw:
        doc = _object(raw["concurrency"], f"{where}: concurrency", ("key", "limit"))
        for key in ("key", "limit"):
            if key not in doc:
                raise Invalid(f'{where}: concurrency needs "{key}"')
        concurrency = Concurrency(key=_key_ref(doc["key"], f"{where}: concurrency.key"),
                                  limit=_integer(doc["limit"], f"{where}: concurrency.limit", 1, MAX_CONCURRENCY))
    rate = None
    if "rate_limit" in raw:
        doc = _object(raw["rate_limit"], f"{where}: rate_limit", ("key", "per_s", "burst"))
        for key in ("key", "per_s"):
            if key not in doc:
                raise Invalid(f'{where}: rate_limit needs "{key}"')
        per_s = _positive(doc["per_s"], f"{where}: rate_limit.per_s", MAX_RATE)
        burst = _integer(doc["burst"], f"{where}: rate_limit.burst", 1, MAX_BURST) if "burst" in doc \
            else max(1, math.ceil(per_s))
        rate = RateLimit(key=_rate_key(doc["key"], f"{where}: rate_limit.key"), per_s=per_s, burst=burst)
    return FlowControl(priority=priority, timeouts=timeouts, concurrency=concurrency, rate_limit=rate)


def key_text(value: Any) -> str:
    """A resolved key as the text tasks are grouped by: a string as it is, anything else
    (a number, null when the path leads nowhere, an object) as canonical JSON. Keys are
    compared as this text, so 42 and "42" are one key (as are true and "true"), and every
    task whose key resolves to nothing shares "null" with the string "null"."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))


def flow_refs(flow: FlowControl) -> Iterator[tuple[str, str]]:
    """The ``$.`` references of the flow control, with where each is (for the graph check)."""
    if flow.concurrency is not None:
        yield "concurrency.key", flow.concurrency.key
    if flow.rate_limit is not None and flow.rate_limit.key_is_ref:
        yield "rate_limit.key", flow.rate_limit.key


def slot_is_free(slot_attempt: int, seen: tuple[int, str] | None) -> bool:
    """Whether a flow slot no longer holds a place under its limit, on Citus, where no
    trigger frees it (composer_ops/repo/citus_flow.py): ``slot_attempt`` is the attempt
    the slot was taken for, ``seen`` the task's (attempt, state) as its node shows it
    (None: no such task). Free only on proof the attempt is over, which stays true (an
    attempt only grows, only a claim makes one RUNNING and takes its slot again, and a
    task made again, by a run's retry, is a new task with a new ID):

    - RUNNING at the slot's attempt: held;
    - PENDING or QUEUED at the slot's attempt: held. The claim that took the slot
      committed on the coordinator before its task's move to RUNNING commits on the
      node (two-phase commit order);
    - another attempt (a re-queue after a failure or a lost lease is the next
      attempt), a finished state, or no task (a run retried or deleted): free."""
    if seen is None:
        return True
    attempt, state = seen
    if attempt != slot_attempt:
        return True
    return state not in ("RUNNING", "PENDING", "QUEUED")
