"""``event`` records of ``metrics.jsonl`` (checkpoint saved, resumed, restart, step skipped,
rollback, ...), the restart count of the ``start`` record, and a rank's own speed for its
liveness record. Every kind and field is documented in docs/metrics.md."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from dtrain.comm.plain import all_gather_json
from dtrain.dist.runtime import Runtime
from dtrain.fault.liveness import Speed
from dtrain.metrics.hardware import memory_bytes

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
    "early_stop",
    "membership",
    "skipped_update",
    "log",
)


def group_restart_attempt(runtime: Runtime) -> int:
    """Collective: how many times the worker group has been restarted -- the largest of the
    machines' own counts. Each machine's launcher counts only the restarts its own workers'
    failure caused: when a rank on another machine dies, the launcher of a healthy machine
    restarts its workers for the new round without counting one (to torch's agent, a change
    of membership), so rank 0's own count may say 0 in a group that has restarted."""
    try:  # how many times this machine's launcher has restarted its workers
        mine = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        mine = 0
    if runtime.world_size == 1 or not dist.is_initialized():
        return mine
    return max(int(count) for count in all_gather_json(mine))


def event(name: str, step: int, **fields: Any) -> Record:
    assert name in EVENTS, name
    return {"kind": "event", "name": name, "step": step, **fields, "time": time.time()}


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
