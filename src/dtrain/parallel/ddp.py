"""``ddp``: torch's DistributedDataParallel, with gradient sync skipped on accumulation
micro-steps through its ``no_sync`` context."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from dtrain.parallel.base import (
    BackwardSyncControl,
    LossFn,
    StepResult,
    Strategy,
    run_micro_batches,
)
from dtrain.task import Task


class DDPStrategy(Strategy, BackwardSyncControl):
    """torch DistributedDataParallel: replicated model, bucketed all-reduce in backward"""

    name = "ddp"

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
        if not self._warmed_up:
            self._warm_up(micro_batches[0], loss_fn)
        return run_micro_batches(self, micro_batches, loss_fn, scale)

    _warmed_up = False

    def _warm_up(self, micro_batch: tuple[Any, Any], loss_fn: LossFn) -> None:
        """One throwaway synced backward before the first real step of this process.

        DDP sums the first backward in one bucket of every gradient, then rebuilds its buckets
        in the order the gradients became ready. Where an element sits in a bucket decides the
        order in which the ranks' values are added, and with 3 or more ranks that order shows
        in the last bits. Without this pass, the first step after a resume (a new DDP) would
        be summed in another layout than the same step of the uninterrupted run, and the
        resumed run would not be bit-identical to it. Eval mode and a zero scale: no dropout
        draws, no BatchNorm statistics, no gradient left behind.
        """
        self._warmed_up = True
        if not isinstance(self.model, DistributedDataParallel) or self.runtime.world_size < 3:
            return  # a sum of two values does not depend on their order
        assert self.module is not None
        inputs, targets = micro_batch
        was_training = self.module.training
        self.module.eval()
        try:
            loss_sum = loss_fn(self.model(inputs), targets).sum()
            (loss_sum * 0.0).backward()
        finally:
            self.module.train(was_training)
            for param in self.module.parameters():
                param.grad = None
