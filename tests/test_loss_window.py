"""The loss of a metrics line: each step's summed loss, added up in float64."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch

from dtrain.metrics.summary import LossWindow


class OneRank:
    """What LossWindow asks of a strategy, on one rank: nothing to sum over."""

    def start_loss_all_reduce(self, tensor: torch.Tensor) -> Callable[[], None]:
        return lambda: None


def test_a_window_longer_than_the_fold_sums_every_step_once() -> None:
    window = LossWindow(torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    losses = [torch.rand((), generator=generator) * 1000 for _ in range(150)]
    for loss in losses:
        window.add(loss, items=7)
        assert len(window._losses) < LossWindow.FOLD  # folded, never held past the fold
    window.start_sum(cast(Any, OneRank()))
    mean, _, steps, _ = window.flush()
    exact = math.fsum(float(loss) for loss in losses)
    assert steps == 150
    assert abs(mean * 150 * 7 - exact) <= 1e-12 * exact
    # The next window starts from zero.
    window.add(torch.tensor(3.5), items=1)
    window.start_sum(cast(Any, OneRank()))
    assert window.flush()[0] == 3.5
