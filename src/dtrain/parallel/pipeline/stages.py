"""Pipeline stage boundaries: cut a chain of layers into K contiguous stages so that the
slowest stage is as fast as possible -- the linear partition problem, solved exactly.

A pipeline runs at the pace of its slowest stage, so the objective is the *maximum* stage cost,
not a spread measure. Given per-layer costs ``c[0..n)`` (e.g. measured forward+backward seconds,
see :mod:`dtrain.parallel.pipeline.profile`) and K stages::

    best[k][i] = the smallest possible maximum when layers i..n-1 form k stages
               = min over j of max(sum(c[i:j]), best[k-1][j])     best[0][n] = 0

computed for k = 1..K in O(K n^2) (pruned: a stage's sum only grows with j, so the scan stops
once it alone reaches the best found). An optional memory limit per stage (layer parameter +
activation bytes, summed over the stage) removes the splits that break it.

Ties go to the earliest boundaries (under 1F1B the first stages hold the most activations),
and stage sums are added left to right as ``sum(costs[i:j])`` does, so the optimum is bit for bit
a brute-force search's (docs/strategies.md, "Pipeline stage balancer").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

from dtrain.errors import ConfigError


@dataclass(frozen=True)
class StagePlan:
    """Stage ``s`` holds layers ``bounds[s]`` to ``bounds[s + 1] - 1``."""

    bounds: tuple[int, ...]  # K + 1 layer indices, from 0 to the number of layers
    costs: tuple[float, ...]  # the summed layer cost of each stage
    memory: tuple[float, ...] | None = None  # summed layer memory of each stage, when given

    @property
    def bottleneck(self) -> float:
        """The cost of the slowest stage: what sets the pipeline's pace."""
        return max(self.costs)

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage (1.0 = perfectly balanced)."""
        mean = sum(self.costs) / len(self.costs)
        return self.bottleneck / mean if mean > 0 else 1.0

    def stages(self) -> list[range]:
        """The layer indices of each stage."""
        return [range(a, b) for a, b in pairwise(self.bounds)]


def balance_stages(
    costs: Sequence[float],
    num_stages: int,
    *,
    memory: Sequence[float] | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> StagePlan:
    """The contiguous split of ``costs`` into ``num_stages`` non-empty stages with the smallest
    maximum stage cost, each stage's summed ``memory`` within ``memory_limit`` (one limit for
    every stage, or one per stage). Raises :class:`ConfigError` on bad input or when no split
    fits the memory limits."""
    costs = _check_values("layer cost", costs)
    n = len(costs)
    _check_stage_count(num_stages, n)
    mem, limits = _check_memory(memory, memory_limit, n, num_stages)

    inf = math.inf
    # best[k][i]: the optimum for layers i..n-1 in k stages (stage index num_stages - k).
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][n] = 0.0
    for k in range(1, num_stages + 1):
        limit = limits[num_stages - k]
        # Stage i..j-1 needs k - 1 more stages after it, so j <= n - k + 1, and i <= n - k.
        for i in range(n - k + 1):
            stage_cost, stage_mem = 0.0, 0.0
            for j in range(i + 1, n - k + 2):
                stage_cost += costs[j - 1]
                stage_mem += mem[j - 1]
                if stage_cost >= best[k][i] or stage_mem > limit:
                    break  # both only grow with j: nothing further can be better or fit
                candidate = max(stage_cost, best[k - 1][j])
                if candidate < best[k][i]:
                    best[k][i] = candidate
    optimum = best[num_stages][0]
    if optimum == inf:
        raise ConfigError(_no_fit_message(mem, limits, n, num_stages))

    # Walk forward taking, for each stage, the earliest end that still allows the optimum.
    bounds = [0]
    for stage in range(num_stages - 1):
        start, remaining = bounds[-1], num_stages - stage - 1
        stage_cost, stage_mem = 0.0, 0.0
        for j in range(start + 1, n - remaining + 1):
            stage_cost += costs[j - 1]
            stage_mem += mem[j - 1]
            if (
                stage_cost <= optimum
                and stage_mem <= limits[stage]
                and best[remaining][j] <= optimum
            ):
                bounds.append(j)
                break
        else:  # pragma: no cover - the table guarantees a feasible end
            raise AssertionError("stage balancer: no boundary reaches the computed optimum")
    bounds.append(n)
    return plan_from_bounds(costs, bounds, memory=memory)


def plan_from_bounds(
    costs: Sequence[float], bounds: Sequence[int], *, memory: Sequence[float] | None = None
) -> StagePlan:
    """The plan for given (e.g. manual or uniform) boundaries: ``[0, b1, ..., n]``."""
    costs = _check_values("layer cost", costs)
    n = len(costs)
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n:
        raise ConfigError(
            f"stage boundaries {list(bounds)} must start at 0 and end at the number of "
            f"layers ({n}), e.g. [0, {n // 2}, {n}] for two stages"
        )
    if any(a >= b for a, b in pairwise(bounds)):
        raise ConfigError(
            f"stage boundaries {list(bounds)} must be strictly increasing: every stage needs "
            "at least one layer"
        )
    pairs = list(pairwise(bounds))
    mem = None if memory is None else _check_memory(memory, None, n, len(pairs))[0]
    return StagePlan(
        bounds=bounds,
        costs=tuple(sum(costs[a:b]) for a, b in pairs),
        memory=None if mem is None else tuple(sum(mem[a:b]) for a, b in pairs),
    )


def uniform_bounds(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Equal layer counts per stage (the first stages take one more when it does not divide):
    the split that ignores costs, as a baseline."""
    _check_stage_count(num_stages, num_layers)
    size, extra = divmod(num_layers, num_stages)
    sizes = (size + 1 if stage < extra else size for stage in range(num_stages))
    return tuple(accumulate(sizes, initial=0))


# -- validation ------------------------------------------------------------------------------


def _check_values(what: str, values: Sequence[float]) -> list[float]:
    out = [float(v) for v in values]
    for index, value in enumerate(out):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"{what} of layer {index} is {value}; {what}s must be finite and >= 0 "
                "(measure them again, or give them by hand)"
            )
    return out


def _check_stage_count(num_stages: int, num_layers: int) -> None:
    if num_stages < 1:
        raise ConfigError(f"{num_stages} pipeline stages asked for; use at least 1")
    if num_layers < 1:
        raise ConfigError("no layers to split into pipeline stages")
    if num_stages > num_layers:
        raise ConfigError(
            f"{num_stages} pipeline stages asked for, but the model has only {num_layers} "
            f"layers to split; use at most {num_layers} stages (every stage needs a layer)"
        )


def _check_memory(
    memory: Sequence[float] | None,
    memory_limit: float | Sequence[float] | None,
    n: int,
    num_stages: int,
) -> tuple[list[float], list[float]]:
    if memory_limit is not None and memory is None:
        raise ConfigError("a stage memory limit needs the memory of each layer (memory=...)")
    mem = [0.0] * n if memory is None else _check_values("layer memory", memory)
    if len(mem) != n:
        raise ConfigError(f"{len(mem)} layer memory sizes given for {n} layers; give one each")
    if memory_limit is None:
        return mem, [math.inf] * num_stages
    if isinstance(memory_limit, int | float):
        limits = [float(memory_limit)] * num_stages
    else:
        limits = [float(v) for v in memory_limit]
        if len(limits) != num_stages:
            raise ConfigError(
                f"{len(limits)} stage memory limits given for {num_stages} stages; give one "
                "limit, or one per stage"
            )
    if any(math.isnan(v) or v < 0 for v in limits):
        raise ConfigError(f"stage memory limits {limits} must be >= 0")
    return mem, limits


def _no_fit_message(mem: list[float], limits: list[float], n: int, num_stages: int) -> str:
    biggest = max(range(n), key=lambda i: mem[i])
    return (
        f"no split of {n} layers into {num_stages} stages keeps every stage within its memory "
        f"limit ({', '.join(f'{v:.4g}' for v in limits)}); layer {biggest} alone needs "
        f"{mem[biggest]:.4g} and all layers together {sum(mem):.4g}. Raise the limit, use "
        "more stages, or lower the memory per layer (smaller micro-batches)"
    )
