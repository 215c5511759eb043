"""The stage balancer: exact on synthetic costs, and balanced when timed for real."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import pytest
import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel.pipeline.profile import balance_layers, profile_layers
from dtrain.parallel.pipeline.refine import refine_plan
from dtrain.parallel.pipeline.stages import (
    StagePlan,
    balance_stages,
    plan_from_bounds,
    uniform_bounds,
)
from tests.chains import unequal_mlp_chain

# -- exactness against brute force -----------------------------------------------------------


def brute_force(
    costs: Sequence[float],
    k: int,
    memory: Sequence[float] | None = None,
    limit: float | None = None,
) -> tuple[float, tuple[int, ...]] | None:
    """(slowest stage, bounds) over every composition of the layers into k stages; ties go to
    the lexicographically smallest bounds. None when no composition fits the memory limit."""
    n = len(costs)
    best: tuple[float, tuple[int, ...]] | None = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        pairs = list(pairwise(bounds))
        if (
            memory is not None
            and limit is not None
            and any(sum(memory[a:b]) > limit for a, b in pairs)
        ):
            continue
        key = (max(sum(costs[a:b]) for a, b in pairs), bounds)
        if best is None or key < best:
            best = key
    return best


def random_costs(rng: random.Random, n: int, flavor: str) -> list[float]:
    if flavor == "ties":  # small integers: many equal optima, zeros included
        return [float(rng.randint(0, 3)) for _ in range(n)]
    if flavor == "uniform":
        return [rng.random() for _ in range(n)]
    if flavor == "near":  # near-ties: optima that differ in the last few digits
        return [1.0 + rng.random() * 1e-3 for _ in range(n)]
    return [rng.paretovariate(1.0) for _ in range(n)]  # heavy-tailed: one layer dominates


def test_equals_brute_force_on_every_small_case() -> None:
    rng = random.Random(0)
    checked = infeasible = 0
    for n in range(1, 11):
        for k in range(1, min(4, n) + 1):
            for flavor in ("ties", "uniform", "near", "heavy"):
                for _ in range(8):
                    costs = random_costs(rng, n, flavor)
                    memory = [float(rng.randint(1, 5)) for _ in range(n)]
                    limit = float(rng.randint(5, 5 + int(sum(memory)) // k))
                    for mem, lim in ((None, None), (memory, limit)):
                        expected = brute_force(costs, k, mem, lim)
                        if expected is None:
                            with pytest.raises(ConfigError, match="memory limit"):
                                balance_stages(costs, k, memory=mem, memory_limit=lim)
                            infeasible += 1
                            continue
                        plan = balance_stages(costs, k, memory=mem, memory_limit=lim)
                        where = f"costs={costs} k={k} memory={mem} limit={lim}"
                        assert (plan.bottleneck, plan.bounds) == expected, where
                        assert plan.costs == plan_from_bounds(costs, plan.bounds).costs, where
                        checked += 1
    assert checked > 1500 and infeasible > 300  # both paths exercised


def test_per_stage_memory_limits() -> None:
    costs = [1.0, 1.0, 1.0, 1.0]
    memory = [4.0, 1.0, 1.0, 1.0]
    # Unconstrained the optimum is [0, 2, 4]; a first stage limited to 4 must take layer 0 alone.
    assert balance_stages(costs, 2).bounds == (0, 2, 4)
    plan = balance_stages(costs, 2, memory=memory, memory_limit=[4.0, 10.0])
    assert plan.bounds == (0, 1, 4) and plan.memory == (4.0, 3.0)


def test_uniform_bounds_and_plan() -> None:
    assert uniform_bounds(10, 4) == (0, 3, 6, 8, 10)
    plan = plan_from_bounds([1.0, 2.0, 3.0, 4.0], [0, 1, 4])
    assert plan.costs == (1.0, 9.0) and plan.stages() == [range(0, 1), range(1, 4)]
    assert plan.imbalance == pytest.approx(9.0 / 5.0)


@pytest.mark.parametrize(
    "costs,k,match",
    [
        ([1.0, 2.0], 3, "only 2 layers"),
        ([1.0, 2.0], 0, "at least 1"),
        ([1.0, -2.0], 1, "layer 1 is -2.0"),
        ([1.0, float("nan")], 1, "must be finite"),
        ([], 1, "no layers"),
    ],
)
def test_bad_input_is_a_config_error(costs: list[float], k: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        balance_stages(costs, k)


def test_bad_memory_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="one each"):
        balance_stages([1.0, 1.0], 1, memory=[1.0], memory_limit=5.0)
    with pytest.raises(ConfigError, match="one per stage"):
        balance_stages([1.0, 1.0], 2, memory=[1.0, 1.0], memory_limit=[5.0])
    with pytest.raises(ConfigError, match="needs the memory of each layer"):
        balance_stages([1.0, 1.0], 2, memory_limit=5.0)
    with pytest.raises(ConfigError, match=r"layer 1 alone needs 9"):
        balance_stages([1.0, 1.0], 2, memory=[1.0, 9.0], memory_limit=5.0)
    with pytest.raises(ConfigError, match="strictly increasing"):
        plan_from_bounds([1.0, 1.0], [0, 0, 2])


# -- profiling -------------------------------------------------------------------------------


def test_gpt_chain_computes_the_model_and_profiles() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32))
    idx = torch.randint(0, 64, (4, 16))
    layers = model.pipeline_layers()
    x = idx
    for layer in layers:
        x = layer(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)
    plan, profiles = balance_layers(layers, idx, 2, warmup=1, repeats=3)
    assert len(profiles) == 5 and plan.bounds[0] == 0 and plan.bounds[-1] == 5
    assert all(p.seconds > 0 and p.activation_bytes > 0 for p in profiles)
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert profiles[1].param_bytes == block_bytes


def test_activation_bytes_of_a_linear_layer() -> None:
    # Linear saves its input for the weight's gradient (the weight itself is a parameter).
    chain = [nn.Linear(8, 8), nn.Linear(8, 32)]
    profiles = profile_layers(chain, torch.randn(16, 8), warmup=0, repeats=1)
    assert profiles[1].activation_bytes == 16 * 8 * 4
    assert profiles[1].param_bytes == (8 * 32 + 32) * 4


# -- refining a plan by timing its stages -----------------------------------------------------


class FakeClock:
    """Seconds that pass only when a :class:`Costly` layer says so: timings are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def read(self) -> float:
        return self.now


class Spend(torch.autograd.Function):
    """Identity whose backward spends ``seconds`` of the fake clock."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: FakeClock, seconds: float) -> torch.Tensor:
        ctx.clock, ctx.seconds = clock, seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.clock.now += ctx.seconds
        return grad, None, None


class Costly(nn.Module):
    """A layer that costs ``seconds`` of the fake clock: half forward, half backward."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.seconds / 2
        return Spend.apply(x * self.weight, self.clock, self.seconds / 2)


def test_refining_corrects_costs_the_profile_got_wrong() -> None:
    clock = FakeClock()
    true = [1.0] * 9 + [3.0] * 3
    layers = [Costly(clock, s) for s in true]
    x = torch.ones(2)
    profiles = profile_layers(layers, x, warmup=0, repeats=1, clock=clock.read)
    assert [p.seconds for p in profiles] == true  # the fake clock is exact
    # A profile that missed how much the last three layers cost (as a cache effect the uncut
    # chain does not show would): equal costs put three layers in each stage.
    wrong = [1.0] * 12
    plain = refine_plan(layers, x, wrong, 4, rounds=0, clock=clock.read)
    assert plain.bounds == (0, 3, 6, 9, 12) and plain.costs == (3.0, 3.0, 3.0, 3.0)
    refined = refine_plan(layers, x, wrong, 4, clock=clock.read)
    # Its costs are the stages' measured times, and the slowest is the best any split of the
    # true costs can do (6: two of the heavy layers share a stage), against 9 unrefined.
    assert refined.costs == plan_from_bounds(true, refined.bounds).costs
    assert refined.bottleneck == balance_stages(true, 4).bottleneck == 6.0
    assert max(plan_from_bounds(true, plain.bounds).costs) == 9.0


def test_refining_keeps_the_plain_plan_when_nothing_measures_better() -> None:
    clock = FakeClock()
    layers = [Costly(clock, 1.0) for _ in range(8)]
    # The profile was right: the first round's correction changes nothing.
    plan = refine_plan(layers, torch.ones(2), [1.0] * 8, 2, clock=clock.read)
    assert plan.bounds == (0, 4, 8) and plan.costs == (4.0, 4.0)


def test_refining_averages_the_timings_it_is_given() -> None:
    clock = FakeClock()
    layers = [Costly(clock, 1.0) for _ in range(4)]
    seen: list[list[float]] = []

    def average(seconds: list[float]) -> list[float]:  # as if another rank measured double
        seen.append(seconds)
        return [s * 1.5 for s in seconds]

    plan = refine_plan(layers, torch.ones(2), [1.0] * 4, 2, clock=clock.read, average=average)
    assert seen == [[2.0, 2.0]] and plan.costs == (3.0, 3.0)


# -- balance, measured -----------------------------------------------------------------------


def pipeline_pass(
    stages: list[nn.Module], x: torch.Tensor, clock: Callable[[], float]
) -> list[float]:
    """Forward+backward seconds of each stage, cut apart as a pipeline cuts them: a stage's
    input is detached (and needs a gradient, except the first stage's), and its backward
    starts from the gradient the next stage sends back."""
    seconds, inputs, outputs = [], [], []
    for index, stage in enumerate(stages):
        x = x.detach().requires_grad_(index > 0)
        inputs.append(x)
        start = clock()
        x = stage(x)
        seconds.append(clock() - start)
        outputs.append(x)
    grad = torch.ones_like(x)
    for index in reversed(range(len(stages))):
        start = clock()
        outputs[index].backward(grad)
        seconds[index] += clock() - start
        grad = inputs[index].grad
    return seconds


def measure_stages(
    layers: list[nn.Module],
    x: torch.Tensor,
    plans: dict[str, StagePlan],
    repeats: int,
    clock: Callable[[], float],
) -> dict[str, list[float]]:
    """Median forward+backward time of each stage of each plan. A repeat runs every plan once,
    so that load from elsewhere on the machine hits all plans alike. (The balancer's own stage
    timer, ``dtrain.parallel.pipeline.refine.time_plans``, chooses among plans; the test judges them
    with this one, written apart, so that a fault in that timer cannot hide itself.)"""
    pipelines = {
        name: [nn.Sequential(*layers[r.start : r.stop]) for r in plan.stages()]
        for name, plan in plans.items()
    }
    samples: dict[str, list[list[float]]] = {name: [] for name in plans}
    for repeat in range(repeats + 1):
        for name, stages in pipelines.items():
            for stage in stages:
                stage.zero_grad(set_to_none=True)
            seconds = pipeline_pass(stages, x, clock)
            if repeat > 0:  # the first is a warm-up
                samples[name].append(seconds)
    return {name: [statistics.median(s) for s in zip(*runs)] for name, runs in samples.items()}


def imbalance(times: list[float]) -> float:
    return max(times) / statistics.mean(times)


# Judged on measured times (thread CPU time, medians of trials): a timing assertion, which the
# default suite does not hold; `make test-slow` runs it. The balancer's logic is tested exactly,
# with a fake clock, above.
@pytest.mark.slow
def test_balanced_stages_measure_balanced_where_uniform_is_not() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # Thread CPU time, not wall time: on a shared machine, time this process spends preempted
    # by others' work would land on whichever layer was running. (Their cache and memory
    # traffic still shows; hence the medians and the trials.)
    clock = time.thread_time
    # 30 light residual MLP blocks, then three times [3 blocks 8x as wide, 6 light ones].
    layers, x = unequal_mlp_chain(128)
    uniform = plan_from_bounds([1.0] * len(layers), uniform_bounds(len(layers), 4))
    # Whole trials (profile, balance, measure) are repeated and the median trial judged: a burst
    # of load from elsewhere can skew one trial's profile or measurement, not most of them.
    trials: list[dict[str, float]] = []
    for _ in range(7):
        plan, _ = balance_layers(layers, x, 4, warmup=2, repeats=11, clock=clock)
        plans = {"balanced": plan, "uniform": uniform}
        measured = measure_stages(layers, x, plans, repeats=11, clock=clock)
        trials.append({name: imbalance(times) for name, times in measured.items()})
        for name, times in measured.items():
            stages = ", ".join(f"{t * 1e3:.1f}" for t in times)
            print(
                f"\n{name:>8} {plans[name].bounds}: stage times [{stages}] ms, slowest/mean = "
                f"{imbalance(times):.3f}",
                end="",
            )
    balanced = statistics.median(t["balanced"] for t in trials)
    uniform_imbalance = statistics.median(t["uniform"] for t in trials)
    print(f"\nmedian trial: balanced {balanced:.3f}, uniform {uniform_imbalance:.3f}")
    assert balanced <= 1.1
    assert uniform_imbalance >= 1.5
