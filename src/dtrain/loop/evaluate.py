"""An own loop's evaluation and its numbers reduced over the ranks (``run.evaluate``,
``run.reduce``; docs/own-loop.md).

The evaluation is dtrain's (:func:`dtrain.train.evaluation.sweep`): the same unpadded
partition of the set over the data-parallel ranks, the same padding forwards where the
strategy's forward is collective, the same reduction of (sum, count) totals in float64 -- so
each value is the mean over every item of the whole set, each item counted once, as one
process would compute it, whatever the world size. Only what is summed is the loop's: the
per-item values its function returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from dtrain.data.loader import to_device
from dtrain.errors import UserError
from dtrain.parallel.base import Strategy
from dtrain.train.evaluation import sweep
from dtrain.train.trainer import Trainer

# fn(inputs, targets) -> the batch's per-item values: one tensor (the loss), or name -> tensor.
EvalFn = Callable[[Any, Any], "torch.Tensor | Mapping[str, torch.Tensor]"]
ReduceOp = Literal["sum", "mean", "max", "min"]

# A mean is a sum divided by the ranks.
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def per_item_values(result: Any) -> dict[str, torch.Tensor]:
    """``fn``'s result as name -> per-item values, checked: a tensor is the loss."""
    values = {"loss": result} if isinstance(result, torch.Tensor) else result
    if not isinstance(values, Mapping) or "loss" not in values:
        raise UserError(
            f"run.evaluate(): fn returned {type(result).__name__}: return the batch's "
            "per-item losses (a tensor, reduction='none'), or a dict of per-item values "
            "with a 'loss' entry (e.g. {'loss': losses, 'correct': (pred == y).float()})"
        )
    for name, value in values.items():
        if not (isinstance(name, str) and name.isidentifier() and name != "items"):
            raise UserError(
                f"run.evaluate(): {name!r} cannot name a value (logged as val_<name>): use an "
                "identifier other than 'items'"
            )
        if not isinstance(value, torch.Tensor):
            raise UserError(
                f"run.evaluate(): fn's {name!r} is a {type(value).__name__}: give a tensor of "
                "per-item values, each item's own (its mean is taken over every item)"
            )
    return dict(values)


def evaluate_in_loop(
    trainer: Trainer,
    data: Any,
    fn: EvalFn,
    collate_fn: Callable[[list[Any]], Any] | None,
    batch_size: int,
    max_samples: int,
) -> dict[str, float]:
    """The mean of each of ``fn``'s per-item values over every item of ``data`` (or its first
    ``max_samples`` samples), reduced over the ranks; the record written to metrics.jsonl as
    dtrain's evaluations write theirs (``val_loss``, ``val_items``: the loss's item count,
    ``val_<name>``). Collective: every rank calls it."""
    if len(data) == 0:
        raise UserError("run.evaluate(): the evaluation set is empty")
    task = trainer.task
    collate = task.collate_fn if collate_fn is None else collate_fn
    view = dataclasses.replace(task, val_data=data, collate_fn=collate)
    strategy = trainer.strategy
    precision = strategy.recipe.precision
    names: list[str] = []
    sums: list[torch.Tensor] = []  # float64 (sum, count) per name, on the device

    def add(pair: tuple[Any, Any], items: int, counted: bool) -> None:
        inputs, targets = pair
        with precision.autocast():
            values = per_item_values(fn(inputs, targets))
        if not names:
            names.extend(values)
            device = trainer.runtime.device
            sums.extend(torch.zeros(2, dtype=torch.float64, device=device) for _ in names)
        if list(values) != names:
            raise UserError(
                f"run.evaluate(): fn returned {', '.join(values)} for one batch and "
                f"{', '.join(names)} for another: return the same names for every batch"
            )
        if counted:
            for total, value in zip(sums, values.values()):
                total[0] += value.detach().to(torch.float64).sum()
                total[1] += value.numel()

    with trainer.phase("evaluate"):
        device, tick = trainer.runtime.device, trainer.watchdog.tick
        sweep(view, strategy, device, batch_size, max_samples, tick, add)
        if not names:  # this rank's share was empty (fewer samples than ranks): fn's names
            # from a batch it does not count. A local forward: a strategy whose forward is
            # collective gave this rank padding batches in the sweep instead.
            module = strategy.unwrapped
            training = module.training
            module.eval()
            with torch.no_grad():
                first = view.split_batch(view.collate_fn([data[0]]))
                add(to_device(first, trainer.runtime.device), 0, False)
            module.train(training)
        # Summed as dtrain's evaluation sums its metrics' (sum, count) pairs.
        totals = strategy.all_reduce_loss(torch.cat(sums))
    means = {}
    for index, name in enumerate(names):
        value, count = float(totals[2 * index]), float(totals[2 * index + 1])
        means[name] = value / count if count > 0 else float("nan")
    items = int(totals[1])
    others = {name: value for name, value in means.items() if name != "loss"}
    trainer.run_log.evaluated(trainer.step, means["loss"], items, others)
    return means


def reduce_over_ranks(strategy: Strategy, value: Any, op: ReduceOp) -> Any:
    """``value`` (a number or a tensor) summed, averaged, or its max or min taken over the
    data-parallel ranks (the ranks that hold different data; a tensor-parallel group's ranks
    hold the same numbers); a number comes back a float (float64 on the way), a tensor a new
    tensor. Collective: every rank calls it."""
    if op not in _OPS:
        raise UserError(f"run.reduce(value, op={op!r}): op is one of {', '.join(_OPS)}")
    is_tensor = isinstance(value, torch.Tensor)
    if not is_tensor and not isinstance(value, (int, float)):
        raise UserError(
            f"run.reduce(): a {type(value).__name__} cannot be reduced: give a number or a tensor"
        )
    device = strategy.runtime.device
    tensor = (
        value.detach().clone()
        if is_tensor
        else torch.tensor(float(value), dtype=torch.float64, device=device)
    )
    size = strategy.data_parallel_size
    if size > 1:
        with strategy.comm.waiting():
            dist.all_reduce(tensor, op=_OPS[op], group=strategy.data_parallel_group)
        strategy.comm.all_reduce(tensor.numel() * tensor.element_size(), size)
    if op == "mean":
        tensor = tensor / size
    return tensor if is_tensor else float(tensor)
