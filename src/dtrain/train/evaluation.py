"""Evaluation: the mean loss over a validation set, and the task's metrics
(``Task.metrics``), every sample counted exactly once across the data-parallel ranks (no
padding duplicates, also when the set does not divide by them).

Each metric gives a batch's (sum, count); the sums and counts are added over every batch and
rank in float64 and divided once at the end -- the value one process would compute over the
whole set, not a mean of the ranks' means (which weighs a rank's share by 1 / its size).

The ranks first take the first data-parallel rank's buffers, which a checkpoint saves, so the
reported loss is the saved model's (:meth:`Strategy.agree_on_buffers`; docs/models.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dtrain.data.loader import eval_batches, split_to_device, to_device
from dtrain.errors import UserError
from dtrain.parallel.base import LossFn, Strategy
from dtrain.task import Task
from dtrain.train.loss_contract import LossContract

# What a metric may not be called: the eval record's own fields are val_loss and val_items.
RESERVED_METRICS = ("loss", "items")


@dataclass
class EvalResult:
    loss: float
    items: int
    metrics: dict[str, float] = field(default_factory=dict)  # name -> sum / count


def check_metrics(metrics: Mapping[str, Any] | None) -> list[str]:
    """The metrics' names, in order, checked: identifiers, none of the reserved ones."""
    if metrics is None:
        return []
    names = list(metrics)
    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_METRICS:
            raise UserError(
                f"Task.metrics: {name!r} cannot name a metric (it is logged as val_<name>): "
                f"use an identifier other than {', '.join(RESERVED_METRICS)}"
            )
        if not callable(metrics[name]):
            raise UserError(
                f"Task.metrics[{name!r}] is not a function fn(output, targets) -> (sum, count)"
            )
    return names


class MetricTotals:
    """Wraps the loss function so that each call, with the output and targets it sees
    (wherever the output is computed: a pipeline's last stage), also adds the task's metrics
    into ``totals`` (float64: sum, count per metric, in the order of ``names``)."""

    def __init__(self, metrics: Mapping[str, Any], names: list[str], device: torch.device):
        self.metrics = metrics
        self.names = names
        self.totals = torch.zeros(2 * len(names), dtype=torch.float64, device=device)
        self.counting = True  # False for a lockstep strategy's padding batches

    def wrap(self, loss_fn: LossFn) -> LossFn:
        if not self.names:
            return loss_fn

        def loss_and_metrics(output: Any, targets: Any) -> torch.Tensor:
            if self.counting:
                self.add(output, targets)
            return loss_fn(output, targets)

        return loss_and_metrics

    def add(self, output: Any, targets: Any) -> None:
        for index, name in enumerate(self.names):
            result = self.metrics[name](output, targets)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise UserError(
                    f"Task.metrics[{name!r}] returned {type(result).__name__}, expected a "
                    "(sum, count) pair for the batch"
                )
            for slot, value in enumerate(result):
                if isinstance(value, torch.Tensor):
                    value = value.detach().to(torch.float64).sum()
                self.totals[2 * index + slot] += value


@torch.no_grad()
def evaluate(
    task: Task,
    strategy: Strategy,
    device: torch.device,
    batch_size: int,
    max_samples: int,
    on_progress: Callable[[], None],
) -> EvalResult:
    """The mean loss, items counted and metrics over ``task.val_data`` (or its first
    ``max_samples`` samples); collective: every rank calls it. ``on_progress`` is called after
    each batch."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    names = check_metrics(task.metrics)
    metrics = MetricTotals(task.metrics or {}, names, device)
    loss_fn = metrics.wrap(LossContract(task.count_items).wrap(task.loss_fn))

    def add(pair: tuple[Any, Any], items: int, counted: bool) -> None:
        metrics.counting = counted
        loss = strategy.eval_loss(pair, loss_fn)
        if counted:
            totals[0] += loss.double()
            totals[1] += items

    sweep(task, strategy, device, batch_size, max_samples, on_progress, add)
    # The loss and the metrics are summed over every rank that computes them (a pipeline's
    # other stages add zeros), the item count over the data-parallel ranks.
    summed = torch.cat([totals[0:1], metrics.totals])
    strategy.all_reduce_loss(summed)
    strategy.all_reduce_sum(totals[1:2])
    items = int(totals[1])
    val_loss = float(summed[0] / totals[1]) if items > 0 else float("nan")
    values: dict[str, float] = {}
    for index, name in enumerate(names):
        value, count = float(summed[1 + 2 * index]), float(summed[2 + 2 * index])
        values[name] = value / count if count > 0 else float("nan")
    return EvalResult(val_loss, items, values)


@torch.no_grad()
def sweep(
    task: Task,
    strategy: Strategy,
    device: torch.device,
    batch_size: int,
    max_samples: int,
    on_progress: Callable[[], None],
    add: Callable[[tuple[Any, Any], int, bool], None],
) -> None:
    """This rank's share of ``task.val_data`` (or of its first ``max_samples`` samples), batch
    after batch, as ``add(pair on the device, items, counted)``: the shares of the
    data-parallel ranks cover the set once, unpadded. Where the strategy has collectives in
    its forward (``lockstep_forward``), a rank with a smaller share then runs padding batches
    (``counted`` False) until every rank ran as many forwards. The ranks' buffers agreed on
    first; the model in eval mode meanwhile. Collective: every rank calls it; the sums are the
    caller's to reduce (:func:`evaluate`, :mod:`dtrain.loop.evaluate`)."""
    assert task.val_data is not None
    strategy.agree_on_buffers()
    module = strategy.unwrapped
    training = module.training
    module.eval()
    dp_size = strategy.data_parallel_size
    batches = eval_batches(
        task.val_data,
        strategy.data_parallel_rank,
        dp_size,
        batch_size,
        task.collate_fn,
        max_samples,
    )
    first: Any = None
    done = 0
    for batch in batches:  # fetched one at a time: a large set is never all in memory
        first = batch if first is None else first
        pair, items = split_to_device(task, batch, device)
        add(pair, items, True)
        done += 1
        on_progress()
    if strategy.capabilities.lockstep_forward:
        total = len(task.val_data) if max_samples <= 0 else min(max_samples, len(task.val_data))
        largest_share = -(-total // dp_size)
        needed = -(-largest_share // batch_size)
        padding = first if first is not None else task.collate_fn([task.val_data[0]])
        for _ in range(needed - done):
            add(to_device(task.split_batch(padding), device), 0, False)
            on_progress()
    module.train(training)
