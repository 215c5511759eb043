"""Close the loop on a stage plan: time its stages as a pipeline cuts them, and correct the
layer costs where the per-layer profile mispredicted them.

The profiler times each layer inside one uncut pass of the chain. A pipeline stage runs a
little differently: its input arrives detached, its backward is a call of its own, and its
tensors meet the caches in another state (the last stage's backward starts right after its
own forward). On the CI machine the last stage measured ~12% faster than a stage of the same
layers earlier in the chain: a plan balanced on paper measured 1.10x slowest/mean. So the plan is
measured: each stage's layer costs are scaled by the stage's measured / predicted time, the
chain is balanced again, and of the plans seen, the one whose slowest stage measures fastest
when all of them are timed side by side wins.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import pairwise

import torch
from torch import nn

from dtrain.parallel.pipeline.stages import StagePlan, balance_stages

Clock = Callable[[], float]
# Combines one list of timings across processes (e.g. the mean over a job's ranks), so that
# every rank makes the same choices from the same numbers. None: this process's timings.
Average = Callable[[list[float]], list[float]]


def refine_plan(
    layers: Sequence[nn.Module],
    example_input: torch.Tensor,
    costs: Sequence[float],
    num_stages: int,
    *,
    memory: Sequence[float] | None = None,
    rounds: int = 2,
    repeats: int = 7,
    clock: Clock = time.perf_counter,
    average: Average | None = None,
) -> StagePlan:
    """Balance ``costs`` (profiled per layer) into ``num_stages`` stages, then correct them
    from the stages' measured times for up to ``rounds`` rounds. The plan returned carries
    each stage's measured seconds as its ``costs``; with ``rounds = 0`` nothing is measured
    and it is the plain balance of ``costs``."""
    if rounds < 0 or repeats < 1:
        raise ValueError(f"refine_plan: rounds = {rounds}, repeats = {repeats}; need >= 0, >= 1")
    costs = [float(c) for c in costs]
    plan = balance_stages(costs, num_stages, memory=memory)
    if rounds == 0:
        return plan
    candidates = [plan]
    measured: list[float] = []
    for _ in range(rounds):
        measured = time_plans(layers, example_input, [plan.bounds], repeats, clock, average)[0]
        costs = corrected(costs, plan, measured)
        plan = balance_stages(costs, num_stages, memory=memory)
        if any(plan.bounds == seen.bounds for seen in candidates):
            break  # settled: the correction leads back to a plan already measured
        candidates.append(plan)
    if len(candidates) == 1:
        return replace(candidates[0], costs=tuple(measured))
    # Measured side by side, so that a change of load between rounds favours no plan.
    timed = time_plans(
        layers, example_input, [c.bounds for c in candidates], repeats, clock, average
    )
    best = min(range(len(candidates)), key=lambda i: max(timed[i]))  # ties: the earliest
    return replace(candidates[best], costs=tuple(timed[best]))


def corrected(costs: Sequence[float], plan: StagePlan, measured: Sequence[float]) -> list[float]:
    """Each layer's cost scaled by its stage's measured / predicted time."""
    out = list(costs)
    for stage, seconds in zip(plan.stages(), measured, strict=True):
        predicted = sum(costs[i] for i in stage)
        for i in stage:
            out[i] = costs[i] * seconds / predicted if predicted > 0 else seconds / len(stage)
    return out


def time_plans(
    layers: Sequence[nn.Module],
    example_input: torch.Tensor,
    plans: Sequence[Sequence[int]],
    repeats: int,
    clock: Clock = time.perf_counter,
    average: Average | None = None,
) -> list[list[float]]:
    """Median forward+backward seconds of each stage of each plan (given by its bounds).
    After one warm-up pass of each, a repeat runs every plan once: load from elsewhere on the
    machine hits all plans alike."""
    samples: list[list[list[float]]] = [[] for _ in plans]
    for repeat in range(repeats + 1):
        for index, bounds in enumerate(plans):
            seconds = stage_pass(layers, bounds, example_input, clock)
            if repeat > 0:
                samples[index].append(seconds)
    medians = [[statistics.median(s) for s in zip(*runs)] for runs in samples]
    if average is None:
        return medians
    flat = average([s for stages in medians for s in stages])
    out, start = [], 0
    for stages in medians:
        out.append(flat[start : start + len(stages)])
        start += len(stages)
    return out


def stage_pass(
    layers: Sequence[nn.Module], bounds: Sequence[int], example_input: torch.Tensor, clock: Clock
) -> list[float]:
    """One forward+backward of the chain cut into stages at ``bounds``; returns each stage's
    seconds. As in a pipeline, a stage's input is detached (and needs a gradient when it is a
    floating-point activation), and its backward starts from the gradient of the next stage's
    input. Gradients are cleared first: the first micro-step of a step."""
    device = example_input.device
    for layer in layers:
        for param in layer.parameters():
            param.grad = None
    seconds: list[float] = []
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    x = example_input
    for index, (start, stop) in enumerate(pairwise(bounds)):
        x = x.detach()
        if index > 0 and x.is_floating_point():
            x.requires_grad_()
        inputs.append(x)
        began = now(device, clock)
        for layer in layers[start:stop]:
            x = layer(x)
        seconds.append(now(device, clock) - began)
        outputs.append(x)
    if not (x.is_floating_point() and x.requires_grad):
        return seconds  # nothing to differentiate: forward only
    grad: torch.Tensor | None = torch.ones_like(x)  # in the loss's place
    for index in reversed(range(len(outputs))):
        if grad is None or not outputs[index].requires_grad:
            break  # no gradient flows further back
        began = now(device, clock)
        outputs[index].backward(grad)
        seconds[index] += now(device, clock) - began
        grad = inputs[index].grad
    return seconds


def now(device: torch.device, clock: Clock) -> float:
    """``clock()``, after the device's queued work has finished (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # time the kernels, not their launch
    return clock()
