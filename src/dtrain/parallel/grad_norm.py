"""The global gradient norm of the 2-D strategies (``tensor``, ``pipeline``), whose gradients lie
in pieces over ranks: each rank sums the squares of the pieces it holds
(:func:`sum_of_squares`), the strategy adds those sums over the ranks that hold different pieces
(which ranks those are is the strategy's to say), and every rank scales its pieces by the same
coefficient (:func:`clip_to_max_norm`).

The 1-D strategies keep torch's ``clip_grad_norm_`` (``Strategy.clip_grad_norm``), and
:func:`gradient_norm` where they only measure the norm; these functions follow its numerics:
float32 sums of squares, ``max_norm / (norm + 1e-6)`` clamped at 1.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


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
