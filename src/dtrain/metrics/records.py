"""The records of ``metrics.jsonl`` that are not measurements: the ``start`` record of each
attempt (what ran, on what) and ``event`` records (checkpoint saved, resumed, restart, step
skipped, rollback). Every kind and field is documented in docs/metrics.md."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from dtrain.comm.plain import all_gather_json
from dtrain.config import Config
from dtrain.dist.runtime import Runtime
from dtrain.fault.liveness import Speed
from dtrain.metrics.hardware import describe, memory_bytes, memory_kind
from dtrain.metrics.summary import Summary
from dtrain.parallel.base import Strategy

Record = dict[str, Any]

# The names of event records, as docs/metrics.md lists them.
EVENTS = (
    "restart",
    "resumed",
    "first_step",
    "checkpoint",
    "checkpoint_failed",
    "step_skipped",
    "overflow",
    "rollback",
    "preempted",
    "membership",
)


def restart_attempt() -> int:
    """How many times this machine's launcher has restarted its workers (0: the first
    attempt). Of one machine only: see :func:`group_restart_attempt`."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def group_restart_attempt(runtime: Runtime) -> int:
    """Collective: how many times the worker group has been restarted -- the largest of the
    machines' own counts. Each machine's launcher counts only the restarts its own workers'
    failure caused: when a rank on another machine dies, the launcher of a healthy machine
    restarts its workers for the new round without counting one (to torch's agent, a change
    of membership), so rank 0's own count may say 0 in a group that has restarted."""
    mine = restart_attempt()
    if runtime.world_size == 1 or not dist.is_initialized():
        return mine
    return max(int(count) for count in all_gather_json(mine))


def event(name: str, step: int, **fields: Any) -> Record:
    assert name in EVENTS, name
    return {"kind": "event", "name": name, "step": step, **fields, "time": time.time()}


def summary_record(summary: Summary, state: str, step: int) -> Record:
    """The run's end: ``state`` is "completed" or "preempted"."""
    return {
        "kind": "summary",
        "state": state,
        "step": step,
        "wall_s": summary.wall_s,
        "train_loss": summary.train_loss,
        "val_loss": summary.val_loss,
        "skipped_steps": summary.skipped_steps,
        "rollbacks": summary.rollbacks,
        "comm_bytes": summary.comm_bytes,
        "comm_wait_s": summary.comm_wait_s,
    }


def eval_record(
    step: int, val_loss: float, items: int, metrics: dict[str, float] | None = None
) -> Record:
    """An eval record; the task's metrics (``Task.metrics``) as ``val_<name>``."""
    return {
        "kind": "eval",
        "step": step,
        "val_loss": val_loss,
        "val_items": items,
        **{f"val_{name}": value for name, value in (metrics or {}).items()},
        "time": time.time(),
    }


def start_record(
    cfg: Config,
    runtime: Runtime,
    strategy: Strategy,
    item_name: str,
    hosts: list[str],
    step: int,
    param_bytes: int,
    attempt: int | None = None,
) -> Record:
    """What this attempt runs, and on what (rank 0's machine); ``param_bytes``: the parameters
    rank 0 holds; ``attempt``: the group's restart count (:func:`group_restart_attempt`; this
    machine's own where not given)."""
    return {
        "kind": "start",
        "step": step,
        "steps": cfg.train.steps,
        "attempt": restart_attempt() if attempt is None else attempt,
        "world_size": runtime.world_size,
        "data_parallel_size": strategy.data_parallel_size,
        "strategy": strategy.name,
        "item_name": item_name,
        "global_batch_size": cfg.data.global_batch_size,
        "hosts": hosts,
        "param_bytes_rank0": param_bytes,
        "memory_kind": memory_kind(runtime.device),
        "hardware": describe(runtime.device),
        "time": time.time(),
    }


def beat_stats(last: dict[str, float], item_name: str, device: torch.device) -> Speed:
    """A rank's own speed and memory for its liveness record (:mod:`dtrain.fault.liveness`),
    from its last step's phases (:attr:`dtrain.balance.timing.StepTimer.last`)."""
    busy = last.get("data_s", 0.0) + last.get("compute_s", 0.0)
    items = last.get("items", 0.0)
    memory = memory_bytes(device)
    return Speed(
        item_name=item_name,
        items_per_s=items / busy if busy > 0 else None,
        step_s=last.get("step_s"),
        memory_bytes=memory if math.isfinite(memory) else None,
    )
