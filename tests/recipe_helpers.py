"""Functions that run inside the ranks for the recipe tests (precision, activation
checkpointing, compile, meta-device initialization): several configs per launch, so that a
comparison of strategies costs one start of the ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.dist_helpers import losses_by_step, make_trainer, params_of


def train_each(raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train each config in turn; per config: the losses by step and the final parameters
    (full, on rank 0)."""
    out = []
    for raw in raws:
        trainer = make_trainer(raw)
        summary = trainer.fit()
        out.append(
            {
                "losses": losses_by_step(raw["run"]["dir"]),
                "params": params_of(trainer),
                "skipped": summary.skipped_steps,
                "events": _events(raw["run"]["dir"]),
                "scale": None if trainer.scaler is None else trainer.scaler.scale,
            }
        )
    return out


def initial_state_each(raws: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
    """Build each config's trainer and return its full model state before any step."""
    return [params_of(make_trainer(raw)) for raw in raws]


def set_up_peak_bytes(raw: dict[str, Any], warm_up: dict[str, Any]) -> int:
    """How much this rank's resident memory rose, at its peak, while the trainer was built
    (the model made and spread over the ranks): the peak is reset just before. The
    ``warm_up`` config's trainer is built first, so that what the first build imports does
    not count."""
    import gc

    import torch.distributed as dist

    make_trainer(warm_up)
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak resident size (VmHWM)
    before = _status_kib("VmRSS")
    make_trainer(raw)
    return (_status_kib("VmHWM") - before) * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _events(run_dir: str) -> list[dict[str, Any]]:
    import json

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "event"]
