"""Two models, two optimizers, two phases per step in a loop of your own: a small GAN that learns
a ring of eight Gaussians in the plane, with dtrain's guarantees kept for both models -- each
wrapped for the run's strategy, its gradients the exact global mean, its optimizer checkpointed
and resumed with the run (docs/own-loop.md).

Three ways to run it (from the repository root)::

    dtrain train --run.script=examples/own_loop_gan.py --nproc 2
    torchrun --nproc-per-node 2 examples/own_loop_gan.py
    python examples/own_loop_gan.py --train.steps=200

Every ``--section.key=value`` of ``dtrain train`` applies: the generator trains with the
config's optimizer (``optim.*``), the critic with Adam. Each sample carries its own latent
vector, so the noise a step sees is the data stream's: the same at any world size.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import dtrain

LATENT = 8


class RingSamples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``(latent, point)`` pairs: a generator's input and a real point of the ring."""

    def __init__(self, count: int = 4096, seed: int = 0) -> None:
        rng = torch.Generator().manual_seed(seed)
        angles = torch.randint(0, 8, (count,), generator=rng) * (2 * math.pi / 8)
        centers = torch.stack([angles.cos(), angles.sin()], dim=1) * 2.0
        self.points = centers + 0.05 * torch.randn(count, 2, generator=rng)
        self.latents = torch.randn(count, LATENT, generator=rng)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.latents[index], self.points[index]


class MLP(nn.Module):
    """Linear layers with ReLU between them (``layers``: the units fsdp shards)."""

    def __init__(self, *sizes: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x) if index == 0 else layer(F.relu(x))
        return x


def samples(targets: torch.Tensor) -> int:
    """A batch's items: its samples (one loss each), not the points' coordinates."""
    return len(targets)


def adam(params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def main(run: dtrain.Run) -> None:
    train_gan(run, adam)


def train_gan(run: dtrain.Run, critic_optimizer_of: Callable[..., torch.optim.Optimizer]) -> None:
    """The loop: per step, the critic's phase and update, then the generator's phase and
    step."""
    generator, _ = run.prepare(MLP(LATENT, 64, 64, 2), RingSamples(), count_items=samples)
    critic, critic_optimizer = run.wrap("critic", MLP(2, 64, 64, 1), optimizer=critic_optimizer_of)
    assert critic_optimizer is not None
    for batch in run.batches():
        for latents, real in batch:  # the critic's phase: the generator's output detached
            with torch.no_grad():
                fake = generator(latents)
            scores = critic(torch.cat([real, fake])).squeeze(1)
            real_scores, fake_scores = scores.chunk(2)
            run.backward(F.softplus(-real_scores) + F.softplus(fake_scores))  # per sample
        run.update(critic_optimizer)
        for latents, _real in batch:  # the generator's phase, through the critic
            run.backward(F.softplus(-critic(generator(latents)).squeeze(1)))
        if run.step():  # the generator's optimizer, then metrics and checkpoints
            break


if __name__ == "__main__":
    dtrain.run_main(main)
