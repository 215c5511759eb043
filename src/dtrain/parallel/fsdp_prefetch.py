"""``strategy.backward_prefetch``: whether FSDP gathers the next block's parameters while a
block runs backward (torch's default), or each block when its own backward begins.

Off, a rank holds one block's parameters less at FSDP's peak (three blocks in backward, not
four: :mod:`dtrain.estimate.fsdp`); the values are the same, since only when the all-gather
runs changes. On a GPU the all-gather then no longer overlaps the backward before it; on CPU
gloo's all-gathers are synchronous, so nothing overlapped.

torch has no switch for it: an empty prefetch list means its default (the next unit in
reverse forward order). A unit told to prefetch itself -- already gathered when its backward
begins -- prefetches nothing.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def apply_backward_prefetch(root: nn.Module, enabled: bool) -> None:
    """Leave torch's backward prefetching on every FSDP unit in ``root`` (``enabled``), or
    turn it off on each. Call after ``fully_shard`` on the units and the root."""
    if enabled:
        return
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_modules_to_backward_prefetch([module])
