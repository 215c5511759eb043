"""A chain of deliberately unequal layers, for the stage balancer's test and benchmark."""

from __future__ import annotations

import torch
from torch import nn


class MLPBlock(nn.Module):
    """A residual MLP block: ``x + down(relu(up(x)))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def unequal_mlp_chain(width: int = 128, rows: int = 128) -> tuple[list[nn.Module], torch.Tensor]:
    """57 residual MLP blocks and an input of ``rows`` rows: 30 light blocks (hidden width
    ``width``), then three times [3 blocks 8x as wide, 6 light ones]. Equal layer counts put 6
    wide blocks in one of 4 stages; the costs allow an even split, and a boundary can move by
    one light block (~3% of a stage) to reach it. Draws from torch's global RNG."""
    units = [1] * 30 + ([8] * 3 + [1] * 6) * 3
    layers: list[nn.Module] = [MLPBlock(width, width * u) for u in units]
    return layers, torch.randn(rows, width)
