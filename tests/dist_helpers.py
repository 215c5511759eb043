"""Functions that run inside the ranks started by :func:`dtrain.testing.run_ranks`."""

from __future__ import annotations

from typing import Any

import numpy as np

from dtrain.config import build_config
from dtrain.fault.rng import seed_everything
from dtrain.runtime import init_runtime
from dtrain.task import build_task, resolve_task, task_config_class
from dtrain.trainer import Trainer


def make_trainer(raw: dict[str, Any]) -> Trainer:
    factory = resolve_task(raw["run"]["task"])
    cfg = build_config(raw, task_config_class(factory))
    runtime = init_runtime(cfg.dist)
    seed_everything(cfg.run.seed)
    task = build_task(factory, cfg)
    return Trainer(cfg, task, runtime)


def train_params(raw: dict[str, Any]) -> dict[str, np.ndarray]:
    """Train with this config; return the final parameters as NumPy arrays."""
    trainer = make_trainer(raw)
    trainer.fit()
    return {
        k: v.detach().cpu().numpy().copy() for k, v in trainer.strategy.model_state_dict().items()
    }


def train_losses(raw: dict[str, Any]) -> list[float]:
    trainer = make_trainer(raw)
    trainer.fit()
    import json
    from pathlib import Path

    lines = (Path(raw["run"]["dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"]
