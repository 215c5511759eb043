"""A CPU copy of a training state that training may go on changing while a save writes it
(:class:`dtrain.checkpoint.write.Checkpointer`'s asynchronous saves)."""

from __future__ import annotations

import sys
from typing import Any

import torch


def snapshot(obj: Any, reuse: Any = None) -> Any:
    """A CPU copy of every tensor in a nested state, so training can go on changing the
    originals while the copy is written.

    ``reuse``: an earlier snapshot of the same state that nothing reads any more. Its tensors
    are copied into where shape, dtype and layout match: copying into memory that is already
    mapped costs a fraction of allocating fresh memory and faulting in every page of it, which
    is most of what the loop waits for in an asynchronous save of a large state.

    A DTensor (a sharded state) keeps its mesh and placements, with a CPU copy of this rank's
    shard (no communication).
    """
    # No DTensor can exist before its module is imported (importing it costs a replicated
    # run a second it never needs).
    dtensors = sys.modules.get("torch.distributed.tensor")
    if dtensors is not None and isinstance(obj, dtensors.DTensor):
        local = obj.to_local().detach().to("cpu", copy=True)
        return dtensors.DTensor.from_local(
            local,
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.shape == obj.shape
            and reuse.dtype == obj.dtype
            and reuse.stride() == obj.stride()
            and reuse.layout == obj.layout == torch.strided
            and not reuse.requires_grad
        ):
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: snapshot(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old_items = list(reuse) if isinstance(reuse, (list, tuple)) else []
        items = [
            snapshot(v, old_items[i] if i < len(old_items) else None) for i, v in enumerate(obj)
        ]
        return items if isinstance(obj, list) else tuple(items)
    return obj
