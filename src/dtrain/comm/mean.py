"""Division by the group size, the "mean" of a mean all-reduce, bit for bit as ``tensor /
divisor``: in place, or into another tensor in the same pass as a copy."""

from __future__ import annotations

import torch


def divide_(tensor: torch.Tensor, divisor: int) -> torch.Tensor:
    """``tensor.div_(divisor)``, bit for bit, in place; returns ``tensor``."""
    return divide_into(tensor, divisor, out=tensor)


def divide_into(tensor: torch.Tensor, divisor: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` = ``tensor / divisor``, bit for bit; returns ``out``.

    A power of two goes as a multiplication by its reciprocal: that reciprocal is exact, so
    both operations round the same real number once and give the same bits (NaNs, infinities
    and subnormals included). On CPU the multiplication takes about half the time of the
    division, which a mean hook pays on every bucket of every step. A divisor of 1 is a copy
    (or nothing, in place)."""
    if divisor == 1:
        return out if out is tensor else out.copy_(tensor)
    if divisor > 0 and divisor & (divisor - 1) == 0:
        return torch.mul(tensor, 1.0 / divisor, out=out)
    return torch.div(tensor, divisor, out=out)
