"""composer_ops: the coordinator and repository of Composer, a durable workflow engine
on PostgreSQL, and the operator's toolbox around its database.

``Engine``, ``Worker``, ``Coordinator`` and ``TaskContext`` are imported on first use,
so ``composer_ops.ops`` in a report's kernel does not load the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_ops.errors import (
    ComposerError,
    Conflict,
    Invalid,
    NonRetryableError,
    NotFound,
    Transient,
    Unavailable,
)

if TYPE_CHECKING:
    from composer_ops.engine import Coordinator, Engine, TaskContext, Worker

_ENGINE_NAMES = frozenset({"Coordinator", "Engine", "TaskContext", "Worker"})

__all__ = [
    "ComposerError",
    "Conflict",
    "Coordinator",
    "Engine",
    "Invalid",
    "NonRetryableError",
    "NotFound",
    "TaskContext",
    "Transient",
    "Unavailable",
    "Worker",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        from composer_ops import engine

        value = getattr(engine, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'composer_ops' has no attribute {name!r}")
