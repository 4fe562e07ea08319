"""composer_ops: the coordinator and repository of Composer, a durable workflow engine
on PostgreSQL, and the operator's toolbox around its database.

``Engine``, ``Worker``, ``Coordinator``, ``TaskContext``, what the engine's calls return
(``Outcome`` of a signal or cancel, ``RunView`` of ``get_run``) and ``new_run_id`` are
imported on first use, so ``composer_ops.ops`` in a report's kernel does not load the
engine. Every error the package raises on purpose is importable from here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_ops.errors import (
    ComposerError,
    Conflict,
    Invalid,
    LockTimeout,
    NonRetryableError,
    NotFound,
    PermissionDenied,
    ShutdownTimeout,
    Transient,
    Unavailable,
)

if TYPE_CHECKING:
    from composer_ops.engine import Coordinator, Engine, TaskContext, Worker
    from composer_ops.engine.ids import new_run_id
    from composer_ops.engine.shell import Outcome
    from composer_ops.repo.rows import RunView

#: The names imported on first use, and the module each comes from.
_LAZY = {
    "Coordinator": "composer_ops.engine",
    "Engine": "composer_ops.engine",
    "TaskContext": "composer_ops.engine",
    "Worker": "composer_ops.engine",
    "Outcome": "composer_ops.engine.shell",
    "RunView": "composer_ops.repo.rows",
    "new_run_id": "composer_ops.engine.ids",
}

__all__ = [
    "ComposerError",
    "Conflict",
    "Coordinator",
    "Engine",
    "Invalid",
    "LockTimeout",
    "NonRetryableError",
    "NotFound",
    "Outcome",
    "PermissionDenied",
    "RunView",
    "ShutdownTimeout",
    "TaskContext",
    "Transient",
    "Unavailable",
    "Worker",
    "new_run_id",
]
__version__ = "0.2.0.dev0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'composer_ops' has no attribute {name!r}")
