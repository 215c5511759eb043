"""Evaluation: the mean loss over a validation set, every sample counted exactly once across
the data-parallel ranks (no padding duplicates, also when the set does not divide by them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtrain.data.loader import eval_batches, split_to_device, to_device
from dtrain.loss_contract import LossContract
from dtrain.parallel.base import LockstepForward, Strategy
from dtrain.task import Task


@torch.no_grad()
def evaluate_loss(
    task: Task,
    strategy: Strategy,
    device: torch.device,
    batch_size: int,
    max_samples: int = 0,
    on_progress: Callable[[], None] | None = None,
) -> tuple[float, int]:
    """(mean loss, items counted) over ``task.val_data`` (or its first ``max_samples``
    samples); collective: every rank calls it. ``on_progress`` is called after each batch."""
    assert task.val_data is not None
    module = strategy.unwrapped
    module.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    dp_size = strategy.data_parallel_size
    batches = eval_batches(
        task.val_data,
        strategy.data_parallel_rank,
        dp_size,
        batch_size,
        task.collate_fn,
        max_samples,
    )
    loss_fn = LossContract(task.count_items).wrap(task.loss_fn)
    first: Any = None
    done = 0
    for batch in batches:  # fetched one at a time: a large set is never all in memory
        first = batch if first is None else first
        pair, items = split_to_device(task, batch, device)
        totals[0] += strategy.eval_loss(pair, loss_fn).double()
        totals[1] += items
        done += 1
        if on_progress is not None:
            on_progress()
    if isinstance(strategy, LockstepForward):
        # Strategies with collectives in forward need the same number of forward passes on
        # every rank: the ranks with a smaller share run padding batches, not counted.
        total = len(task.val_data) if max_samples <= 0 else min(max_samples, len(task.val_data))
        largest_share = -(-total // dp_size)
        needed = -(-largest_share // batch_size)
        padding = first if first is not None else task.collate_fn([task.val_data[0]])
        for _ in range(needed - done):
            inputs, targets = to_device(task.split_batch(padding), device)
            strategy.eval_loss((inputs, targets), loss_fn)
            if on_progress is not None:
                on_progress()
    strategy.all_reduce_loss(totals[0:1])
    strategy.all_reduce_sum(totals[1:2])
    module.train()
    val_loss = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
    return val_loss, int(totals[1])
