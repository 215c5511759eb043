"""The records of ``metrics.jsonl`` that are not measurements: the ``start`` record of each
attempt (what ran, on what) and ``event`` records (checkpoint saved, resumed, restart, step
skipped, rollback). Every kind and field is documented in docs/metrics.md."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

from dtrain.config import Config
from dtrain.metrics.hardware import describe, memory_bytes, memory_kind
from dtrain.parallel.base import Strategy
from dtrain.runtime import Runtime

Record = dict[str, Any]

# The names of event records, as docs/metrics.md lists them.
EVENTS = (
    "restart",
    "resumed",
    "checkpoint",
    "checkpoint_failed",
    "step_skipped",
    "rollback",
    "preempted",
)


def restart_attempt() -> int:
    """How many times the launcher has restarted the worker group (0: the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def event(name: str, step: int, **fields: Any) -> Record:
    assert name in EVENTS, name
    return {"kind": "event", "name": name, "step": step, **fields, "time": time.time()}


def start_record(
    cfg: Config, runtime: Runtime, strategy: Strategy, item_name: str, hosts: list[str], step: int
) -> Record:
    """What this attempt runs, and on what (rank 0's machine)."""
    return {
        "kind": "start",
        "step": step,
        "steps": cfg.train.steps,
        "attempt": restart_attempt(),
        "world_size": runtime.world_size,
        "data_parallel_size": strategy.data_parallel_size,
        "strategy": strategy.name,
        "item_name": item_name,
        "global_batch_size": cfg.data.global_batch_size,
        "hosts": hosts,
        "param_bytes_rank0": strategy.parameter_bytes(),
        "memory_kind": memory_kind(runtime.device),
        "hardware": describe(runtime.device),
        "time": time.time(),
    }


def beat_stats(last: dict[str, float], item_name: str, device: torch.device) -> dict[str, Any]:
    """A rank's own speed and memory for its heartbeat file (:mod:`dtrain.fault.beats`), from
    its last step's phases (:attr:`dtrain.balance.timing.StepTimer.last`)."""
    busy = last.get("data_s", 0.0) + last.get("compute_s", 0.0)
    items = last.get("items", 0.0)
    memory = memory_bytes(device)
    return {
        "step_s": last.get("step_s"),
        f"{item_name}_per_s": items / busy if busy > 0 else None,
        "memory_bytes": memory if math.isfinite(memory) else None,
    }
