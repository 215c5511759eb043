"""A slowdown you can dial: a testing and demonstration aid, never for real training.

``debug.slowdown_rank = R`` with ``debug.slowdown_factor = F`` makes rank ``R`` about ``F``
times slower at forward + backward from step ``debug.slowdown_from_step`` to
``debug.slowdown_to_step`` (-1: to the end), as a slower device would be. After every training
forward of a micro-batch (before its backward, so the gradient sync waits for it) the rank
sleeps ``(F - 1)`` x its own estimate of that micro-batch's compute time: the smoothed compute
time per item of its recent steps, measured without the sleeps, times the items of the
micro-batch. So the slowdown is in proportion to the rank's work: give it a smaller share and
it gets faster, which is what lets the throughput controller converge (and what a benchmark of
it needs).

The sleep needs an estimate: the first step of a process is never slowed, nor counted in the
estimate (it holds one-off set-up). Evaluation and DDP's warm-up pass (no gradient, or eval
mode) are not slowed.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

ESTIMATE_SMOOTHING = 0.3  # weight of the newest step in the compute-per-item estimate


class Slowdown:
    """Sleeps in a forward hook of ``module`` on the slowed rank (see the module docstring)."""

    def __init__(self, module: nn.Module, factor: float, from_step: int, to_step: int) -> None:
        self.factor = factor
        self.from_step = from_step
        self.to_step = to_step
        self.per_item: float | None = None  # estimated compute seconds per item, no sleeps
        self.slept = 0.0  # seconds slept in the current step
        self._per_forward = 0.0
        self._steps_seen = 0
        self._handle = module.register_forward_hook(self._after_forward)

    def active(self, step: int) -> bool:
        return self.from_step <= step and (self.to_step < 0 or step <= self.to_step)

    def begin(self, step: int, items: int, micro_steps: int) -> None:
        """Step ``step`` (1 = the first of the run) is about to run forward and backward."""
        self.slept = 0.0
        self._per_forward = 0.0
        if self.active(step) and self.per_item is not None and micro_steps > 0:
            self._per_forward = (self.factor - 1.0) * self.per_item * items / micro_steps

    def end(self, compute_s: float, items: int) -> None:
        """The step's measured compute time (sleeps included) and items: update the estimate."""
        self._steps_seen += 1
        if self._steps_seen == 1 or items <= 0:
            return  # the process's first step holds set-up: not a measure of its speed
        raw = max(0.0, compute_s - self.slept) / items
        if self.per_item is None:
            self.per_item = raw
        else:
            self.per_item += ESTIMATE_SMOOTHING * (raw - self.per_item)

    def _after_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if self._per_forward > 0 and module.training and torch.is_grad_enabled():
            started = time.perf_counter()
            time.sleep(self._per_forward)
            self.slept += time.perf_counter() - started

    def remove(self) -> None:
        self._handle.remove()
