"""``ddp``: torch's DistributedDataParallel, with gradient sync skipped on accumulation
micro-steps through its ``no_sync`` context."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from dtrain.parallel.base import BackwardSyncControl, LossFn, StepResult, Strategy, register
from dtrain.task import Task


def run_micro_batches(
    strategy: Strategy,
    micro_batches: Sequence[tuple[Any, Any]],
    loss_fn: LossFn,
    scale: torch.Tensor,
) -> StepResult:
    """The data-parallel step: gradient sync only on the last micro-batch."""
    assert strategy.model is not None
    total: torch.Tensor | None = None
    last = len(micro_batches) - 1
    for index, (inputs, targets) in enumerate(micro_batches):
        ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if index < last and isinstance(strategy, BackwardSyncControl):
            ctx = strategy.no_backward_sync()
        with ctx:
            loss_sum = loss_fn(strategy.model(inputs), targets).sum()
            (loss_sum * scale).backward()
        total = loss_sum.detach() if total is None else total + loss_sum.detach()
    assert total is not None, "a step has at least one micro-batch"
    return StepResult(loss_sum=total)


@register("ddp")
class DDPStrategy(Strategy, BackwardSyncControl):
    """torch DistributedDataParallel: replicated model, bucketed all-reduce in backward"""

    def setup(self, task: Task) -> None:
        self.module = task.model.to(self.runtime.device)
        if self.runtime.world_size > 1:
            device_ids = [self.runtime.device.index] if self.runtime.device.type == "cuda" else None
            self.model = DistributedDataParallel(
                self.module,
                device_ids=device_ids,
                bucket_cap_mb=self.cfg.strategy.bucket_mb,
                find_unused_parameters=self.cfg.strategy.find_unused_parameters,
            )
        else:
            self.model = self.module

    def no_backward_sync(self) -> contextlib.AbstractContextManager[None]:
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def forward_backward(
        self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, scale: torch.Tensor
    ) -> StepResult:
        return run_micro_batches(self, micro_batches, loss_fn, scale)
