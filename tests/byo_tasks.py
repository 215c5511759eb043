"""Tasks that bring their own parts (tests.byo_tasks:<name>): an optimizer, a schedule and
metrics of the task's own (:func:`classifier`), and a small CNN with BatchNorm (:func:`cnn`).
Each also runs in one process as a hand-written loop, the reference the tests compare with."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from dtrain.config import Config
from dtrain.task import Task, task_config

CLASSES = 4


class Clusters(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points around one of ``CLASSES`` centres, labelled by the centre (with some overlap:
    accuracy is well below 1 for a while)."""

    def __init__(self, n: int, dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(CLASSES, dim, generator=torch.Generator().manual_seed(99))
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.x = centres[self.y] + 1.5 * torch.randn(n, dim, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    return (logits.argmax(-1) == labels).sum(), labels.numel()


def mean_confidence(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A real-valued metric: the probability given to the right class, per sample."""
    probs = logits.softmax(-1).gather(1, labels[:, None])
    return probs.sum(), labels.numel()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class MLP(nn.Module):
    def __init__(self, dim: int = 8, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def own_optimizer(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """SGD with momentum, the head in a group of its own at a tenth of the rate."""
    head = [p for name, p in named if name.startswith("head.")]
    rest = [p for name, p in named if not name.startswith("head.")]
    return torch.optim.SGD([{"params": rest}, {"params": head, "lr": 0.05}], lr=0.5, momentum=0.9)


def own_scheduler(
    optimizer: torch.optim.Optimizer, steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


@dataclass
class ClassifierOptions:
    train_samples: int = 96
    val_samples: int = 37  # not a multiple of the ranks or of eval.batch_size
    own_optimizer: bool = True
    own_scheduler: bool = True
    # "foreign": the optimizer updates another model's parameters (an error).
    optimizer_over: str = "given"


@task_config(ClassifierOptions)
def classifier(cfg: Config) -> Task:
    opts: ClassifierOptions = cfg.task
    model = MLP()
    build_optimizer: Any = own_optimizer if opts.own_optimizer else None
    if opts.optimizer_over == "foreign":

        def build_optimizer(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
            return torch.optim.SGD(MLP().parameters(), lr=0.1)

    return Task(
        model=model,
        train_data=Clusters(opts.train_samples, seed=1),
        val_data=Clusters(opts.val_samples, seed=2),
        loss_fn=class_loss,
        build_optimizer=build_optimizer,
        build_scheduler=own_scheduler if opts.own_scheduler else None,
        metrics={"accuracy": accuracy, "confidence": mean_confidence},
        shard_units=lambda m: list(m.blocks),
        items_per_sample=1,
    )


# -- a small CNN with BatchNorm --------------------------------------------------------------


class Images(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random 8x8 RGB images, labelled by which channel is brightest on average; off-centre
    (mean 0.5, scale 2) so that BatchNorm's statistics matter."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = 0.5 + 2.0 * torch.randn(n, 3, 8, 8, generator=g)
        self.y = self.x.mean(dim=(2, 3)).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.conv(x)))


class SmallCNN(nn.Module):
    """conv-BN-ReLU stem, two residual conv-BN blocks, a BatchNorm1d before the head."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.stem_norm = nn.BatchNorm2d(channels)
        self.blocks = nn.ModuleList([ConvBlock(channels), ConvBlock(channels)])
        self.pool_norm = nn.BatchNorm1d(channels, momentum=None)  # a cumulative average
        self.head = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_norm(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.pool_norm(x.mean(dim=(2, 3))))


@dataclass
class CNNOptions:
    train_samples: int = 64
    val_samples: int = 27
    batchnorm: bool = True  # False: the CNN without its BatchNorm layers (Identity)


@task_config(CNNOptions)
def cnn(cfg: Config) -> Task:
    opts: CNNOptions = cfg.task
    model = SmallCNN()
    if not opts.batchnorm:
        model = strip_batchnorm(model)
    return Task(
        model=model,
        train_data=Images(opts.train_samples, seed=1),
        val_data=Images(opts.val_samples, seed=2),
        loss_fn=class_loss,
        shard_units=lambda m: list(m.blocks),
        items_per_sample=1,
    )


def strip_batchnorm(model: nn.Module) -> nn.Module:
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                setattr(parent, name, nn.Identity())
    return model


# -- the hand-written single-process loop ----------------------------------------------------


def batches_in_order(data: Dataset[Any], batch: int, steps: int) -> Iterator[tuple[Any, Any]]:
    """The global batches of a run with ``data.shuffle = 'none'``: samples in order, epoch
    after epoch."""
    n = len(data)  # type: ignore[arg-type]
    for step in range(steps):
        ids = [(step * batch + i) % n for i in range(batch)]
        xs, ys = zip(*(data[i] for i in ids))
        yield torch.stack(xs), torch.stack(ys)


def reference_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    data: Dataset[Any],
    batch: int,
    steps: int,
) -> list[float]:
    """One process: the mean loss over each global batch, backward, step; the losses."""
    losses = []
    model.train()
    for x, y in batches_in_order(data, batch, steps):
        loss = class_loss(model(x), y).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
    return losses
