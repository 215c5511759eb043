"""A slowdown you can dial, for the load-balancing tests and benchmark: one rank about F times
slower at forward + backward over a range of steps, as a slower device would be.

A task takes the options of :class:`SlowdownOptions` in its ``[task]`` section
(``tests.tasks:tiny_gpt`` does) and calls :func:`slow_down` on its model. After every training
forward of a micro-batch (before its backward, so the gradient sync waits for it) the slowed rank
sleeps ``(F - 1)`` x its own estimate of that micro-batch's compute time: the smoothed compute
time per sample of its recent steps, times the micro-batch's samples. A step's compute is the
rank's own work, as the product's step timer counts it: from the step's start (the
``train.step`` fail point) to its last gradient accumulated, plus its optimizer step; not the
wait for its peers in the gradient sync, nor the sleeps. So the slowdown is in proportion to the
rank's work: give it a smaller share and it gets faster, which is what lets the throughput
controller converge (and what a benchmark of it needs).

Steps are numbered by the trainer's ``train.step`` fail point (1 = the first of the run). The
first step of a process is never slowed, nor counted in the estimate (it holds one-off set-up);
evaluation (eval mode, or no gradient) is not slowed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from dtrain.errors import ConfigError
from dtrain.fault.failpoints import set_handler

ESTIMATE_SMOOTHING = 0.3  # weight of the newest step in the compute-per-sample estimate


@dataclass
class SlowdownOptions:
    # The rank made slower (-1 = none), how many times slower, and its first and last slowed
    # steps (-1 = to the end).
    slowdown_rank: int = field(default=-1, metadata={"min": -1})
    slowdown_factor: float = field(default=2.0, metadata={"min": 1})
    slowdown_from_step: int = field(default=0, metadata={"min": 0})
    slowdown_to_step: int = field(default=-1, metadata={"min": -1})

    def __post_init__(self) -> None:
        if 0 <= self.slowdown_to_step < self.slowdown_from_step:
            raise ConfigError(
                f"task.slowdown_to_step = {self.slowdown_to_step} is before "
                f"task.slowdown_from_step = {self.slowdown_from_step}: no step would be slowed"
            )


def slow_down(model: nn.Module, opts: SlowdownOptions) -> Slowdown | None:
    """On the rank ``opts`` slows (RANK in the environment, as the launcher sets it): its
    :class:`Slowdown`, stepped by the ``train.step`` fail point. None on the other ranks."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if opts.slowdown_rank >= world_size:
        raise ConfigError(
            f"task.slowdown_rank = {opts.slowdown_rank}: there is no rank {opts.slowdown_rank} "
            f"in a job of {world_size} rank(s) (ranks are 0..{world_size - 1}); pick one of "
            "those, or -1 for none"
        )
    if opts.slowdown_rank != int(os.environ.get("RANK", "0")) or opts.slowdown_factor <= 1:
        return None
    slowdown = Slowdown(model, opts.slowdown_factor, opts.slowdown_from_step, opts.slowdown_to_step)
    previous = set_handler(None)

    def on_failpoint(name: str, /, **args: Any) -> None:
        if name == "train.step":
            slowdown.start_step(int(args["step"]))
        if previous is not None:  # a handler installed before this one still sees every point
            previous(name, **args)

    set_handler(on_failpoint)
    return slowdown


class Slowdown:
    """Sleeps in a forward hook of ``module`` (see the module docstring)."""

    def __init__(self, module: nn.Module, factor: float, from_step: int, to_step: int) -> None:
        self.factor = factor
        self.from_step = from_step
        self.to_step = to_step
        self.step = 0  # the step being trained; 0 before the first
        self.per_sample: float | None = None  # estimated compute seconds per sample, no sleeps
        self._started: float | None = None  # when this step started
        self._compute_end: float | None = None  # when this step's latest gradient was ready
        self._optimizer_s = 0.0  # this step's optimizer step
        self._optimizer_started = 0.0
        self._slept = 0.0  # seconds slept in this step
        self._samples = 0  # samples of this step's forwards
        self._steps_seen = 0
        module.register_forward_hook(self._after_forward)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._gradient_ready)
        # Every optimizer's, in this process: the task's model has one (the rank's).
        register_optimizer_step_pre_hook(self._optimizer_starts)
        register_optimizer_step_post_hook(self._optimizer_ended)

    def active(self, step: int) -> bool:
        return self.from_step <= step and (self.to_step < 0 or step <= self.to_step)

    def start_step(self, step: int) -> None:
        """Step ``step`` is about to run forward and backward: the one before it is done."""
        self._finish_step()
        self.step = step
        self._started = time.perf_counter()
        self._compute_end = None
        self._optimizer_s = 0.0
        self._slept = 0.0
        self._samples = 0

    def _finish_step(self) -> None:
        if self._started is None:
            return  # no step yet
        started, self._started = self._started, None
        self._steps_seen += 1
        if self._steps_seen == 1 or self._samples == 0:
            return  # the process's first step holds set-up: not a measure of its speed
        if self._compute_end is None:
            return  # no gradient this step: nothing measured
        busy = self._compute_end - started - self._slept + self._optimizer_s
        raw = max(0.0, busy) / self._samples
        if self.per_sample is None:
            self.per_sample = raw
        else:
            self.per_sample += ESTIMATE_SMOOTHING * (raw - self.per_sample)

    def _training(self, module: nn.Module) -> bool:
        return self.step > 0 and module.training and torch.is_grad_enabled()

    def _after_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if not self._training(module):
            return
        samples = len(inputs[0])  # the micro-batch's samples, batch-first
        self._samples += samples
        if self.active(self.step) and self.per_sample is not None:
            started = time.perf_counter()
            time.sleep((self.factor - 1.0) * self.per_sample * samples)
            self._slept += time.perf_counter() - started

    def _optimizer_starts(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_started = time.perf_counter()

    def _optimizer_ended(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_s += time.perf_counter() - self._optimizer_started

    def _gradient_ready(self, param: torch.Tensor) -> None:
        if self._started is not None:
            self._compute_end = time.perf_counter()
