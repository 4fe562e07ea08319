"""The shell around the pure core: Engine, Worker, Coordinator."""

from composer_ops.engine.coordinator import Coordinator
from composer_ops.engine.engine import Engine
from composer_ops.engine.worker import TaskContext, Worker

__all__ = ["Coordinator", "Engine", "TaskContext", "Worker"]
