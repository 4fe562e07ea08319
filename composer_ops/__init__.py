"""composer_ops: the coordinator and repository of Composer, a durable workflow engine
on PostgreSQL, and the operator's toolbox around its database."""

from composer_ops.engine import Coordinator, Engine, TaskContext, Worker
from composer_ops.errors import ComposerError, Conflict, Invalid, NonRetryableError, NotFound, Unavailable

__all__ = [
    "ComposerError",
    "Conflict",
    "Coordinator",
    "Engine",
    "Invalid",
    "NonRetryableError",
    "NotFound",
    "TaskContext",
    "Unavailable",
    "Worker",
]
__version__ = "0.1.0"
