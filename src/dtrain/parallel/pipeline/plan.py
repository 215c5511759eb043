"""Where the pipeline cuts the model: manual boundaries, equal layer counts, or the stage
balancer fed with layer times measured on this job's own devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.config import StrategyConfig
from dtrain.errors import ConfigError
from dtrain.parallel.pipeline.profile import balance_layers
from dtrain.parallel.pipeline.stages import StagePlan, plan_from_bounds, uniform_bounds


def check_stage_count(num_stages: int, num_layers: int, model: nn.Module) -> None:
    if num_stages > num_layers:
        raise ConfigError(
            f"strategy.pipeline_stages: {num_stages} pipeline stages, but "
            f"{type(model).__name__} has only {num_layers} layers to split; use at most "
            f"{num_layers} stages (every stage needs a layer)"
        )


def choose_plan(
    opts: StrategyConfig,
    layers: Sequence[nn.Module],
    num_stages: int,
    example: Any,
) -> StagePlan:
    """The stage boundaries. Collective when profiling: every rank measures the chain and the
    times are averaged over the world, so that every rank computes the same plan from the same
    numbers."""
    n = len(layers)
    if opts.pipeline_boundaries:
        bounds = [0, *opts.pipeline_boundaries, n]
        if bounds[-2] >= n:
            raise ConfigError(
                f"strategy.pipeline_boundaries = {opts.pipeline_boundaries}: the model has "
                f"only {n} layers (0 to {n - 1}); every stage needs at least one"
            )
        return plan_from_bounds([1.0] * n, bounds)
    if opts.pipeline_balance == "uniform" or num_stages == 1:
        return plan_from_bounds([1.0] * n, uniform_bounds(n, num_stages))
    return profiled_plan(layers, example, num_stages)


def profiled_plan(layers: Sequence[nn.Module], example: Any, num_stages: int) -> StagePlan:
    """The balanced plan from each layer's forward+backward seconds, corrected by timing the
    plan's stages as cut (:func:`refine_plan`); every timing is averaged over the ranks. The
    measurement leaves no trace: RNG states, buffers (e.g. batch-norm statistics) and
    gradients are as they were."""
    if not isinstance(example, torch.Tensor):
        raise ConfigError(
            "strategy.pipeline_balance = 'profile' needs the model's input to be one tensor; "
            "give strategy.pipeline_boundaries, or use pipeline_balance = 'uniform'"
        )

    def average(seconds: list[float]) -> list[float]:
        if not dist.is_initialized():
            return seconds
        summed = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(summed)
        return [float(s) for s in summed / dist.get_world_size()]

    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    devices = [example.device] if example.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        plan, _ = balance_layers(layers, example, num_stages, average=average)
    with torch.no_grad():
        for buf, saved in buffers:
            buf.copy_(saved)
    for layer in layers:
        for param in layer.parameters():
            param.grad = None
    return plan


def example_input(task_data: Any, collate: Any, split: Any, rows: int, device: Any) -> Any:
    """One micro-batch of inputs (the first ``rows`` training samples), for profiling."""
    from dtrain.data.loader import to_device

    samples = [task_data[i] for i in range(min(rows, len(task_data)))]
    inputs, _ = split(collate(samples))
    return to_device(inputs, device)
