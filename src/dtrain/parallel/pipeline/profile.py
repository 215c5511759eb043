"""Measure what each layer of a chain costs -- forward+backward time, parameter bytes and the
activation bytes its forward keeps for backward -- on the device it will run on, and split the
chain into balanced pipeline stages from those measurements (then corrected by timing the
chosen stages as cut: :mod:`dtrain.parallel.pipeline.refine`).

Times are medians over several repeats, after warm-up. Each repeat is one forward+backward of
the whole chain with each layer's share timed inside it: so a burst of load from elsewhere on
the machine hits all layers alike instead of inflating one, and each layer sees the caches as a
real step leaves them. ``clock`` picks the timer: wall time by default (with CUDA synchronized
around each reading); ``time.thread_time`` on a shared CPU machine with one intra-op thread
counts only this process's own work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain.parallel.pipeline.refine import Average, Clock, now, refine_plan
from dtrain.parallel.pipeline.stages import StagePlan


@dataclass(frozen=True)
class LayerProfile:
    seconds: float  # median forward+backward time of the layer
    param_bytes: int
    activation_bytes: int  # tensors its forward saves for backward (parameters excluded)

    @property
    def memory_bytes(self) -> int:
        """What the layer adds to its stage's memory for one micro-batch in flight."""
        return self.param_bytes + self.activation_bytes


def profile_layers(
    layers: Sequence[nn.Module],
    example_input: torch.Tensor,
    *,
    warmup: int = 2,
    repeats: int = 7,
    clock: Clock = time.perf_counter,
) -> list[LayerProfile]:
    """Profile each layer of the chain ``layers[0] -> layers[1] -> ...`` fed ``example_input``
    (one micro-batch, on the target device)."""
    if not layers:
        raise ValueError("profile_layers: no layers given")
    if repeats < 1:
        raise ValueError(f"profile_layers: repeats = {repeats}; use at least 1")
    for _ in range(warmup):
        chain_pass(layers, example_input, clock)
    samples = [chain_pass(layers, example_input, clock) for _ in range(repeats)]
    profiles = []
    x = example_input
    for index, (layer, times) in enumerate(zip(layers, zip(*samples))):
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        saved = _saved_bytes(layer, x, first=index == 0)
        profiles.append(LayerProfile(statistics.median(times), param_bytes, saved))
        with torch.no_grad():
            x = layer(x)  # the next layer's input
    return profiles


def chain_pass(
    layers: Sequence[nn.Module], example_input: torch.Tensor, clock: Clock = time.perf_counter
) -> list[float]:
    """One forward+backward of the whole chain; returns each layer's forward+backward seconds.

    Timing each layer inside a full pass, rather than one layer over and over, keeps the
    memory traffic of a real step: by the time a layer's backward runs, the other layers have
    evicted its activations and weights from the caches. The chain stays one graph (not cut at
    every layer, which would add per-cut costs that a stage of many layers never pays): a hook
    on each layer's output notes when its gradient is complete, which is when that layer's
    backward starts and the next layer's ends."""
    device = example_input.device
    for layer in layers:
        for param in layer.parameters():
            param.grad = None  # the first micro-step of a step: no accumulation into .grad
    seconds: list[float] = []
    outputs: list[torch.Tensor] = []
    x = example_input
    for layer in layers:
        start = now(device, clock)
        x = layer(x)
        seconds.append(now(device, clock) - start)
        outputs.append(x)
    if not (x.is_floating_point() and x.requires_grad):
        return seconds  # nothing to differentiate: forward only
    # marks[i]: when the gradient of layer i's output was complete. The last layer's starts
    # with backward(); the first layer's backward ends when backward() returns.
    marks: list[float | None] = [None] * len(layers)

    def mark(index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            marks[index] = now(device, clock)

        return hook

    for index, out in enumerate(outputs[:-1]):
        if out.requires_grad:
            out.register_hook(mark(index))
    marks[-1] = now(device, clock)
    x.backward(torch.ones_like(x))
    finished = now(device, clock)
    for index in range(len(layers)):
        began = marks[index]
        ended = finished if index == 0 else marks[index - 1]
        if began is not None and ended is not None:  # else: no gradient flowed through it
            seconds[index] += ended - began
    return seconds


def balance_layers(
    layers: Sequence[nn.Module],
    example_input: torch.Tensor,
    num_stages: int,
    *,
    warmup: int = 2,
    repeats: int = 7,
    refine_rounds: int = 2,
    clock: Clock = time.perf_counter,
    average: Average | None = None,
) -> tuple[StagePlan, list[LayerProfile]]:
    """Profile the chain, then choose the stage boundaries with the fastest slowest stage,
    corrected for up to ``refine_rounds`` rounds by timing the plan's stages as a pipeline cuts
    them (see :mod:`dtrain.parallel.pipeline.refine`). The plan's ``costs`` are its stages' measured
    seconds (with ``refine_rounds = 0``: the sums of the profiled layer times). ``average``
    combines every list of timings across ranks (the same plan on each: see
    :func:`dtrain.parallel.pipeline.plan.profiled_plan`)."""
    profiles = profile_layers(layers, example_input, warmup=warmup, repeats=repeats, clock=clock)
    seconds = [p.seconds for p in profiles]
    plan = refine_plan(
        layers,
        example_input,
        average(seconds) if average is not None else seconds,
        num_stages,
        memory=[p.memory_bytes for p in profiles],
        rounds=refine_rounds,
        repeats=repeats,
        clock=clock,
        average=average,
    )
    return plan, profiles


# -- measuring -------------------------------------------------------------------------------


def _saved_bytes(module: nn.Module, x: torch.Tensor, *, first: bool) -> int:
    """Bytes of the distinct tensors autograd keeps from one forward of ``module``, fed ``x``
    as a stage receives it (detached; needing a gradient unless it is the model's input)."""
    x = x.detach()
    if not first and x.is_floating_point():
        x.requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(storages.values())
