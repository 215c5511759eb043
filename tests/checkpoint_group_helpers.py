"""Run on every rank by tests/test_checkpoint_group.py (importable: a forkserver child runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.checkpoint import layout
from dtrain.checkpoint.write import Checkpointer


def save_twice(root: str) -> dict[str, Any]:
    """A blocking-only checkpointer and a background one, each saving one step: which group
    each coordinates over, and the steps committed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for name, background, step in (("blocking", False, 1), ("background", True, 2)):
        saver = Checkpointer(
            Path(root) / name,
            rank=rank,
            world_size=world,
            keep_last=2,
            keep_every=0,
            background=background,
            log=lambda _: None,
        )
        state = {"w": torch.full((3,), float(rank + step))}
        saver.save(step, {f"rank{rank}.pt": state}, {"step": step}, blocking=not background)
        assert saver.wait() is None
        out[name] = {
            "own_group": saver.group is not None,
            "group_size": dist.get_world_size(saver.group),
            "committed": layout.committed_steps(Path(root) / name) if rank == 0 else None,
        }
    return out
