"""The global gradient norm of the strategies on a mesh (``fsdp``, ``tensor``, ``pipeline`` and
their products), whose gradients lie in pieces over ranks: each rank sums the squares of the
pieces it holds (:func:`sum_of_squares`), the sums are added over the ranks that hold
different pieces (:func:`mesh_gradient_norm`: a ``DTensor`` gradient says which dimensions
cut it), and every rank scales its pieces by the same coefficient (:func:`clip_to_max_norm`).

The 1-D strategies keep torch's ``clip_grad_norm_`` (``Strategy.clip_grad_norm``), and
:func:`gradient_norm` where they only measure the norm; these functions follow its numerics:
float32 sums of squares, ``max_norm / (norm + 1e-6)`` clamped at 1.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from dtrain.parallel.mesh import Mesh


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a torch ``DTensor``, without importing ``torch.distributed.tensor``
    (0.55 s, TorchDynamo included) into a process that never made one: where that module is
    not loaded, no DTensor exists."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a ``DTensor`` (a plain tensor is its own)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squared elements of plain tensors, as a float32 scalar (0 for none)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.stack([n.float() for n in norms]).square().sum()


def clip_to_max_norm(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale plain gradient tensors in place so that a global ``norm`` becomes at most
    ``max_norm``; ``max_norm = 0`` leaves them as they are (the norm is only measured)."""
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coefficient)


def gradient_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together: ``torch.nn.utils.get_total_norm``'s value.

    When every gradient is a plain tensor of one device and dtype (the usual case) this is
    get_total_norm's own arithmetic -- a norm per tensor by ``torch._foreach_norm``, then the
    norm of those -- without its grouping by device and dtype, which a step pays every time.
    Anything else (DTensors, mixed dtypes or devices) goes through get_total_norm."""
    if not grads:
        return torch.nn.utils.get_total_norm(grads)
    first = grads[0]
    if all(
        type(g) is torch.Tensor and g.device == first.device and g.dtype == first.dtype
        for g in grads
    ):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return torch.nn.utils.get_total_norm(grads)


def cut_dims(tensor: torch.Tensor) -> frozenset[str]:
    """The mesh dimensions a ``DTensor`` is cut over (sharded, or partial sums): its pieces
    there differ and add up. A plain tensor is whole on every rank."""
    if not is_dtensor(tensor):
        return frozenset()
    from torch.distributed.tensor import Replicate

    names = tensor.device_mesh.mesh_dim_names or ()
    # Anything but Replicate cuts: Shard, Partial, and FSDP's _StridedShard over a
    # tensor-parallel shard (whose is_shard() says False).
    return frozenset(
        names[i] for i, p in enumerate(tensor.placements) if not isinstance(p, Replicate)
    )


def mesh_gradient_norm(
    grads: Sequence[torch.Tensor],
    mesh: Mesh,
    device: torch.device,
    disjoint: Sequence[str] = (),
) -> torch.Tensor:
    """The 2-norm of gradients spread over ``mesh``: the squares of each gradient's local
    piece, summed over the dimensions that cut it (and over every ``disjoint`` dimension,
    whose ranks hold different gradients altogether: a pipeline's stages). Collective over
    the mesh; bit for bit the same on every rank (replicas must clip alike)."""
    used = [name for name in mesh.dims.used if name not in disjoint]
    bit = {name: 1 << i for i, name in enumerate(used)}
    by_cut: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        key = sum(bit[name] for name in cut_dims(grad) if name in bit)
        by_cut.setdefault(key, []).append(local_part(grad))
    # sums[k]: the squares of the gradients cut over the dimensions in bitmask k.
    sums = torch.zeros(1 << len(used), dtype=torch.float32, device=device)
    for key, tensors in by_cut.items():
        sums[key] = sum_of_squares(tensors, device)
    for name in used:
        group = mesh.group(name)
        if group is None:
            continue
        cut_here = [k for k in range(len(sums)) if k & bit[name]]
        part = sums[cut_here]
        dist.all_reduce(part, group=group)
        sums[cut_here] = part
    total = sums.sum()
    for name in disjoint:
        group = mesh.group(name)
        if group is not None:
            dist.all_reduce(total, group=group)
    norm = total.sqrt()
    if mesh.device_mesh is not None:
        # Replicas that summed the same numbers in another order may differ in the last bit.
        dist.all_reduce(norm, op=dist.ReduceOp.MAX)
    return norm
