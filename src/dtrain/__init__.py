"""dtrain: distributed training for PyTorch -- exact, resumable, fault tolerant."""

from __future__ import annotations

__version__ = "0.1.0"

from dtrain.config import Config
from dtrain.config_load import load_config
from dtrain.task import Task, task_config

__all__ = ["Config", "Task", "__version__", "load_config", "task_config"]
