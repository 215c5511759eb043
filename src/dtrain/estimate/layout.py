"""What one rank holds of the model's state, from the shapes alone: its parameters (whole, a
tensor-parallel slice, an FSDP shard, a pipeline stage's), their gradients, the optimizer's
state, and the optimizer step's temporaries.

Shapes come from the model built on the meta device; nothing here allocates. The rules are
those of the code that lays the state out: tensor parallelism cuts a column-wise linear map's
weight and bias along their outputs (dim 0) and a row-wise one's weight along its inputs
(dim 1), its bias whole (:mod:`dtrain.parallel.tensor_plan`); FSDP2 cuts dim 0 of each
(local) tensor into equal parts, padded to a multiple of the shard count; the optimizer's
state follows :func:`dtrain.compute.optim.build_optimizer`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dtrain.config import OptimConfig

ADAMW_STEP_BYTES = 4  # AdamW's step count: one float32 scalar tensor per parameter


@dataclass(frozen=True)
class TensorInfo:
    """One parameter or buffer of the model (a tied parameter once)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool
    trainable: bool
    cut: str | None = None  # tensor parallelism: "colwise" or "rowwise" (None: whole)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.element_size

    def local_meta(self, tp: int = 1) -> torch.Tensor:
        """A meta tensor of the shape one rank holds (tensor parallelism only)."""
        return torch.empty(self.local_shape(tp), dtype=self.dtype, device="meta")

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one rank of a ``tp``-way tensor-parallel group holds."""
        if tp == 1 or self.cut is None:
            return self.shape
        if self.cut == "colwise":
            return (self.shape[0] // tp, *self.shape[1:])
        if len(self.shape) < 2:  # a row-wise map's bias stays whole
            return self.shape
        return (self.shape[0], self.shape[1] // tp, *self.shape[2:])

    def local_bytes(self, tp: int = 1, shards: int = 1) -> int:
        """Bytes one rank holds: its tensor-parallel slice, then its FSDP shard."""
        shape = self.local_shape(tp)
        if shards > 1 and shape:
            rows = -(-shape[0] // shards)
            return rows * math.prod(shape[1:]) * self.element_size
        return math.prod(shape) * self.element_size

    def gathered_bytes(self, tp: int, shards: int) -> int:
        """Bytes of the whole (tensor-parallel local) tensor as FSDP gathers it: every
        rank's padded shard."""
        return self.local_bytes(tp, shards) * shards


def model_tensors(model: nn.Module, cuts: dict[str, str] | None = None) -> list[TensorInfo]:
    """The model's parameters (each tensor once, by its first name) and buffers, with the
    tensor-parallel cut of each (``cuts``: module name -> style)."""
    cuts = cuts or {}
    seen: set[int] = set()
    out = []
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        owner, _, leaf = name.rpartition(".")
        cut = cuts.get(owner)
        if cut == "rowwise" and leaf != "weight":
            cut = None
        out.append(
            TensorInfo(name, tuple(param.shape), param.dtype, True, param.requires_grad, cut)
        )
    for name, buf in model.named_buffers():
        if id(buf) not in seen:
            seen.add(id(buf))
            out.append(TensorInfo(name, tuple(buf.shape), buf.dtype, False, False))
    return out


def tensors_of(
    modules: Iterable[nn.Module], infos: Sequence[TensorInfo], model: nn.Module
) -> list[TensorInfo]:
    """The entries of ``infos`` (of ``model``'s tensors) that ``modules`` hold, each once."""
    index = {info.name: info for info in infos}
    named: list[tuple[str, torch.Tensor]] = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    by_id = {id(tensor): index[name] for name, tensor in named if name in index}
    held = (by_id.get(id(t)) for m in modules for t in (*m.parameters(), *m.buffers()))
    return list({info.name: info for info in held if info is not None}.values())


@dataclass(frozen=True)
class OptimizerBytes:
    state: int  # kept from the first step on
    temporary: int  # made and freed inside each optimizer step


def optimizer_bytes(
    tensors: Sequence[TensorInfo], cfg: OptimConfig, tp: int, shards: int, device: torch.device
) -> OptimizerBytes:
    """The optimizer's state on one rank, and the largest temporary of its step.

    AdamW keeps two tensors per parameter (first and second moments) and a scalar step
    count; its foreach step makes one tensor list the size of a parameter group's parameters
    of one dtype at a time (the moments' square roots). SGD with momentum keeps one buffer per
    parameter (none at momentum 0); with weight decay its step adds the decay term out of
    place: a temporary the size of one parameter (one tensor at a time, CPU) or of a group
    (foreach, CUDA). Fused kernels (``optim.implementation = 'fused'``) update each tensor in
    place, with no temporaries."""
    trainable = [t for t in tensors if t.is_parameter and t.trainable]
    sizes = [t.local_bytes(tp, shards) for t in trainable]
    # build_optimizer: matrices (dim >= 2) decay, the rest do not; one group without decay.
    groups: dict[tuple[bool, int, bool], int] = {}
    largest: dict[bool, int] = {}
    for info, size in zip(trainable, sizes):
        decays = cfg.weight_decay > 0 and len(info.shape) >= 2
        cut = (tp > 1 and info.cut is not None) or shards > 1  # DTensors: a list of their own
        key = (decays, info.element_size, cut)
        groups[key] = groups.get(key, 0) + size
        largest[decays] = max(largest.get(decays, 0), size)
    total = sum(sizes)
    fused = cfg.implementation == "fused"
    if cfg.name == "adamw":
        return OptimizerBytes(
            2 * total + ADAMW_STEP_BYTES * len(sizes),
            0 if fused else max(groups.values(), default=0),
        )
    state = total if cfg.momentum > 0 else 0
    if cfg.weight_decay == 0 or fused:
        return OptimizerBytes(state, 0)
    if device.type == "cuda":
        temporary = max((v for (decays, _, _), v in groups.items() if decays), default=0)
    else:
        temporary = largest.get(True, 0)
    return OptimizerBytes(state, temporary)


def bucket_bytes(tensors: Sequence[TensorInfo], cap_bytes: int, tp: int = 1) -> list[int]:
    """The bytes of each flat bucket the trainable parameters (or their gradients) are cut
    into, in reverse registration order (the order backward finishes them), as
    :func:`dtrain.parallel.grad_sync.assign_buckets` cuts them."""
    from dtrain.parallel.grad_sync import assign_buckets

    metas = [t.local_meta(tp) for t in reversed(tensors) if t.is_parameter and t.trainable]
    return [
        sum(metas[i].numel() * metas[i].element_size() for i in members)
        for members in assign_buckets(metas, cap_bytes)
    ]
