"""What the pure machine reads while it decides an event (its ``Store``), and the run's
context, served in the event's transaction under the run's lock
(:mod:`composer_ops.engine.shell`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from composer_ops.core.model import ItemState, RunContext, Signal
from composer_ops.repo import items, runs, signals
from composer_ops.repo._base import Conn

__all__ = ["NOTHING_YET", "LazyContext", "RunStore", "run_context"]


class RunStore:
    """The machine's reads, served in the event's transaction."""

    def __init__(self, conn: Conn, run_id: str) -> None:
        self._conn, self._run_id = conn, run_id

    def load_outputs(self, node_ids: Collection[str]) -> Mapping[str, Any]:
        return runs.load_outputs(self._conn, self._run_id, sorted(node_ids))

    def pending_signals(self, name: str) -> Sequence[Signal]:
        return signals.pending_signals(self._conn, self._run_id, name)

    def load_item(self, node_id: str, task_id: str) -> ItemState | None:
        return items.item_state(self._conn, self._run_id, node_id, task_id)

    def item_outputs(self, node_id: str) -> Sequence[Any]:
        return items.item_outputs(self._conn, self._run_id, node_id)


class _NothingYet:
    """The machine's reads for a run not inserted yet (its start): nothing to read."""

    def load_outputs(self, node_ids: Collection[str]) -> Mapping[str, Any]:
        return {}

    def pending_signals(self, name: str) -> Sequence[Signal]:
        return []

    def load_item(self, node_id: str, task_id: str) -> ItemState | None:
        return None

    def item_outputs(self, node_id: str) -> Sequence[Any]:
        return []


NOTHING_YET = _NothingYet()


def run_context(stored: Any) -> RunContext:
    """The machine's context from the run's stored ``context_json``."""
    context = stored or {}
    return RunContext(input=context.get("input"), config=context.get("config") or {})


class LazyContext(RunContext):
    """A run's context read on first use, in the event's transaction under the run's
    lock: most events (a task's or a MAP item's completion) never read it, and a run's
    input can be large (a MAP over a list in the input: 34 KB at 10,000 IDs, which every
    event loaded and parsed when the lock read it)."""

    def __init__(self, load: Callable[[], RunContext]) -> None:
        object.__setattr__(self, "_load", load)
        object.__setattr__(self, "_loaded", None)

    def _value(self) -> RunContext:
        loaded: RunContext | None = object.__getattribute__(self, "_loaded")
        if loaded is None:
            loaded = object.__getattribute__(self, "_load")()
            object.__setattr__(self, "_loaded", loaded)
        return loaded

    @property
    def input(self) -> Any:
        return self._value().input

    @property
    def config(self) -> Mapping[str, Any]:
        return self._value().config
