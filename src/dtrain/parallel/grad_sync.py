"""Data-parallel averaging of flat buckets of tensors, for every strategy that averages tensors
itself: the gradients of the 2-D strategies' data-parallel dimension (pipeline, tensor), local
SGD's warm-up gradients and its parameters at a sync, DiLoCo's outer gradients. One way to cut
tensors into buckets (:func:`assign_buckets`, also the ``allreduce`` strategy's) and one
numerics for the mean (:func:`average_flat`: each rank divides by the group size, then the
values are summed -- the mean of torch's ``allreduce_hook`` and of our ``MeanHook``; every rank
gets the same bits, the reduced buffer)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from dtrain.comm.accounting import CommCounter
from dtrain.comm.mean import divide_

MIB = 1024 * 1024


def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices of ``params`` grouped into buckets of at most ``cap_bytes`` (a tensor larger
    than that gets a bucket of its own), keeping the given order. A bucket holds one dtype and
    device only, since it is flattened into one buffer; tensors of another kind fill their own
    open bucket, as in DDP. Buckets are returned in the order of their first tensor."""
    buckets: list[list[int]] = []
    filling: dict[tuple[torch.dtype, torch.device], list[int]] = {}  # one open bucket per kind
    filled_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    for index, param in enumerate(params):
        kind = (param.dtype, param.device)
        size = param.numel() * param.element_size()
        if kind in filling and filled_bytes[kind] + size > cap_bytes:
            buckets.append(filling.pop(kind))  # this tensor would overflow it: close it
        if kind not in filling:
            filling[kind], filled_bytes[kind] = [], 0
        filling[kind].append(index)
        filled_bytes[kind] += size
    buckets.extend(filling.values())
    return sorted(buckets, key=lambda members: members[0])


def average_flat(
    flat: torch.Tensor, group: dist.ProcessGroup | None, counter: CommCounter | None = None
) -> torch.Tensor:
    """The mean of ``flat`` over ``group``, in place (counted in ``counter``); returns it. One
    process without a process group (a job of one rank) is its own mean."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return flat
    divide_(flat, size)
    if counter is None:
        dist.all_reduce(flat, group=group)
    else:
        with counter.waiting():
            dist.all_reduce(flat, group=group)
        counter.all_reduce(flat.numel() * flat.element_size(), size)
    return flat


@torch.no_grad()
def average_in_buckets(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, bucket_mb: float
) -> None:
    """Average ``tensors`` over ``group`` in place, in flat buckets of at most ``bucket_mb``
    MiB (one collective per bucket, not per tensor)."""
    cap = max(1, int(bucket_mb * MIB))
    for members in assign_buckets(tensors, cap):
        average_bucket([tensors[i] for i in members], group, None)


@torch.no_grad()
def average_bucket(
    bucket: Sequence[torch.Tensor], group: dist.ProcessGroup | None, counter: CommCounter | None
) -> None:
    """Average ``bucket``'s tensors over ``group`` in place, flattened into one collective."""
    flat = average_flat(torch.cat([t.reshape(-1) for t in bucket]), group, counter)
    for tensor, part in zip(bucket, split_like(flat, bucket)):
        tensor.copy_(part)


def split_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``flat`` cut into views shaped like ``like``, in order."""
    for part, tensor in zip(flat.split([t.numel() for t in like]), like):
        yield part.view_as(tensor)
