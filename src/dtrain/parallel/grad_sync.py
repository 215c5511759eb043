"""Averaging gradients over a data-parallel group after the backward pass, in flat buckets:
what the 2-D strategies (pipeline, tensor) do for their data-parallel dimension."""

from __future__ import annotations

import torch
import torch.distributed as dist


def average_gradients(
    grads: list[torch.Tensor], group: dist.ProcessGroup | None, bucket_mb: float
) -> None:
    """Average gradients over the data-parallel group, in flat buckets of at most
    ``bucket_mb`` MiB (one collective per bucket, not per tensor)."""
    size = dist.get_world_size(group)
    limit = max(1, int(bucket_mb * 2**20))
    bucket: list[torch.Tensor] = []
    used = 0
    for grad in [*grads, None]:
        if grad is not None and (not bucket or used + grad.numel() * grad.element_size() <= limit):
            bucket.append(grad)
            used += grad.numel() * grad.element_size()
            continue
        if bucket:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat /= size
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        bucket, used = ([grad], grad.numel() * grad.element_size()) if grad is not None else ([], 0)
