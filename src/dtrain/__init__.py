"""dtrain: distributed training for PyTorch -- exact, resumable, fault tolerant."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from dtrain.config import Config
    from dtrain.config.load import load_config
    from dtrain.loop import Run
    from dtrain.task import Task, task_config
    from dtrain.weights.init_from import load_weights
    from dtrain.worker import run_main

__all__ = [
    "Config",
    "Run",
    "Task",
    "__version__",
    "load_config",
    "load_weights",
    "run_main",
    "task_config",
]

# Imported when first used (PEP 562), not with the package: `dtrain.task` imports torch (1.2 s
# here), which commands that only read files (`dtrain status`, `dtrain report`) never need.
_EXPORTS = {
    "Config": "dtrain.config",
    "load_config": "dtrain.config.load",
    "load_weights": "dtrain.weights.init_from",
    "Run": "dtrain.loop",
    "run_main": "dtrain.worker",
    "Task": "dtrain.task",
    "task_config": "dtrain.task",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
