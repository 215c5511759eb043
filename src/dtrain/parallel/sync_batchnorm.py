"""``strategy.sync_batchnorm``: BatchNorm over the whole global (micro-)batch, as one process
computes it, on any backend and device (torch's ``SyncBatchNorm`` needs NCCL; docs/models.md,
"BatchNorm under data parallelism"). Every BatchNorm layer's training forward sums per channel
its share's values, squared values and count, and all-reduces the sums over the data-parallel
ranks in one small collective -- sums and counts, so unequal shares are exact::

    d = x - K                      K: the running mean (the same on every rank), a shift that
                                   keeps the squares from cancelling; 0 without running stats
    [sum d, sum d^2, count]        per channel, float64, all-reduced (autograd: the backward
                                   all-reduces the gradients of the sums the same way)
    mean = K + S / N,  var = Q / N - (S / N)^2        (biased, as BatchNorm normalizes)
    y = (x - mean) / sqrt(var + eps) * weight + bias
    running stats <- momentum update with the unbiased var (var * N / (N - 1)), as torch does

The backward's all-reduce is what makes the gradients exact: each rank's loss depends on the
other ranks' inputs through the shared statistics. With every rank's loss scaled by
``data_parallel_size / G`` (dtrain.train.step), summing those gradients and letting the strategy
average the parameter gradients gives the gradient of one process's global mean.

Each layer keeps its class and names (its ``forward`` is replaced on the instance), so
checkpoints and exports are unchanged; evaluation and a ``copy.deepcopy`` normalize as plain
BatchNorm, with no collective.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dtrain.errors import UserError

# layer -> the data-parallel group its statistics are summed over (None: the world). Weak:
# a copy of the model is not in it, and normalizes as a plain BatchNorm.
_GROUPS: weakref.WeakKeyDictionary[nn.Module, dist.ProcessGroup | None] = (
    weakref.WeakKeyDictionary()
)


def apply_sync_batchnorm(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make every BatchNorm layer of ``model`` normalize over ``group``'s whole batch, in
    place. A model without one is the user's mistake."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    if not layers:
        raise UserError(
            "strategy.sync_batchnorm = true, but the model has no BatchNorm layer "
            "(nn.BatchNorm1d/2d/3d): there are no statistics to synchronize; set it to false"
        )
    for layer in layers:
        _GROUPS[layer] = group
        layer.forward = types.MethodType(_synced_forward, layer)  # type: ignore[method-assign]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group in forward; the gradient of every rank's copy of the sum, summed
    the same way, in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def _synced_forward(self: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    if self not in _GROUPS:  # a copy (see _GROUPS)
        return type(self).forward(self, input)
    group = _GROUPS[self]
    local = not self.training or not dist.is_initialized() or dist.get_world_size(group) == 1
    if local:
        return type(self).forward(self, input)
    self._check_input_dim(input)
    channels = input.shape[1]
    dims = [0, *range(2, input.dim())]
    view = [1, channels] + [1] * (input.dim() - 2)  # a channel vector, broadcast over x
    # Half-precision inputs (autocast) are normalized in float32, double ones in double.
    x = input if input.dtype == torch.float64 else input.float()
    if self.running_mean is not None:
        shift = self.running_mean.detach().to(torch.float64)
    else:
        shift = torch.zeros(channels, dtype=torch.float64, device=input.device)
    d = x - shift.to(x.dtype).view(view)
    count = torch.full((1,), input.numel() // channels, dtype=torch.float64, device=input.device)
    local_sums = torch.cat(
        [d.sum(dims, dtype=torch.float64), (d * d).sum(dims, dtype=torch.float64), count]
    )
    sums = _AllReduceSum.apply(local_sums, group)
    total = sums[2 * channels]  # a tensor: reading it on the host would wait for a GPU
    mean_d = sums[:channels] / total
    var = (sums[channels : 2 * channels] / total - mean_d * mean_d).clamp_min(0)
    mean = shift + mean_d
    invstd = torch.rsqrt(var + self.eps)
    y = (x - mean.to(x.dtype).view(view)) * invstd.to(x.dtype).view(view)
    if self.weight is not None:
        y = y * self.weight.view(view) + self.bias.view(view)
    if self.track_running_stats and self.running_mean is not None:
        _update_running_stats(self, mean.detach(), var.detach(), total.detach())
    return y.to(input.dtype)


@torch.no_grad()
def _update_running_stats(
    layer: _BatchNorm, mean: torch.Tensor, var: torch.Tensor, total: torch.Tensor
) -> None:
    """torch's update: momentum (or, with ``momentum=None``, the cumulative average over the
    batches seen) towards the batch's mean and unbiased variance."""
    assert layer.running_mean is not None and layer.running_var is not None
    assert layer.num_batches_tracked is not None
    layer.num_batches_tracked.add_(1)
    # momentum=None: the cumulative average (torch reads the count on the host too).
    momentum = layer.momentum
    factor = momentum if momentum is not None else 1.0 / float(layer.num_batches_tracked)
    # A single value per channel in the whole batch gives inf here (torch's BatchNorm raises;
    # checking would make the host wait for the device in every layer).
    unbiased = var * (total / (total - 1))
    running_mean, running_var = layer.running_mean, layer.running_var
    running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
    running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
