"""Your own model and data with dtrain: an MLP that classifies points of three interleaved
spirals, from an ordinary ``torch.utils.data.Dataset``.

Run it on 2 workers (from the repository root)::

    dtrain train --run.task=examples.spirals:build --nproc 2

or with its own options::

    dtrain train --run.task=examples.spirals:build --task.hidden=128 --train.steps=400

All dtrain needs is a task factory: a function from the config to a ``dtrain.Task`` holding the
model, the datasets and a loss that returns *unreduced* per-sample losses (dtrain averages them
over the whole global batch, exactly, whatever the number of workers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import dtrain


class Spirals(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points on three noisy spiral arms; the label is the arm."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        label = torch.randint(0, 3, (size,), generator=g)
        radius = torch.rand(size, generator=g)
        angle = radius * 4.0 + label * (2 * math.pi / 3) + 0.25 * torch.randn(size, generator=g)
        self.points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
        self.labels = label

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[index], self.labels[index]


@dataclass
class SpiralOptions:
    hidden: int = 64
    train_size: int = 20_000
    val_size: int = 2_000


def accuracy_report(model: nn.Module) -> str:
    data = Spirals(2_000, seed=1)
    with torch.no_grad():
        predicted = model(data.points).argmax(dim=1)
    return f"validation accuracy: {(predicted == data.labels).float().mean():.1%}"


@dtrain.task_config(SpiralOptions)
def build(cfg: dtrain.Config) -> dtrain.Task:
    opts: SpiralOptions = cfg.task
    model = nn.Sequential(
        nn.Linear(2, opts.hidden),
        nn.GELU(),
        nn.Linear(opts.hidden, opts.hidden),
        nn.GELU(),
        nn.Linear(opts.hidden, 3),
    )
    return dtrain.Task(
        model=model,
        train_data=Spirals(opts.train_size, seed=0),
        val_data=Spirals(opts.val_size, seed=1),
        loss_fn=lambda logits, labels: F.cross_entropy(logits, labels, reduction="none"),
        after_training=accuracy_report,
        # One label per sample: the ranks know each step's item count without counting it.
        items_per_sample=1,
    )
