"""Per-rank batch shares from measured speed: a pure controller, unit-testable without
processes (docs/load-balancing.md, "The controller", gives its update rule and defaults).

The weights (mean 1; :func:`dtrain.data.partition.split_counts` cuts each global batch by them)
move toward ``p_r ∝ 1 / t_r``, the shares that give every rank the same busy time, from smoothed
times, by a bounded factor per window. Hysteresis keeps noise from moving the shares (each move
re-plans the data); once a move starts it is finished (``SETTLE``), not left just inside the
band. The floor (``min_weight``) keeps every rank in the job with samples.
:class:`StragglerDetector` names a rank whose time per item stays above the others' median by
more than a threshold for a window of steps, with its dominant phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Floats = Sequence[float] | np.ndarray  # one number per rank


# Once moving, the weights follow the target until the predicted gain is below this fraction
# of the hysteresis: a move is finished, not stopped just inside the band that started it.
SETTLE = 0.25


@dataclass(frozen=True)
class ControllerSettings:
    smoothing: float = 0.5  # weight of the newest window in the moving average
    max_change: float = 0.25  # largest relative change of one weight in one update
    hysteresis: float = 0.05  # predicted step-time gain below which nothing moves
    min_weight: float = 0.1  # floor of a weight, as a fraction of an equal share


def target_weights(times: Floats, min_weight: float) -> np.ndarray:
    """Weights (mean 1) in proportion to speed ``1 / times``, each at least ``min_weight``:
    a rank below the floor is held at it and the others share the rest by speed."""
    t = np.asarray(times, dtype=np.float64)
    n = len(t)
    speed = 1.0 / t
    pinned = np.zeros(n, dtype=bool)
    while True:
        free = ~pinned
        spare = n - min_weight * int(pinned.sum())
        target = np.where(free, speed / speed[free].sum() * spare, min_weight)
        low = free & (target < min_weight)
        if not low.any() or low.sum() == free.sum():
            return target
        pinned |= low  # each round pins at least one rank: ends within n rounds


def step_time(weights: Floats, times: Floats) -> float:
    """The busiest rank's time for one item of the global batch, shares by ``weights``."""
    w = np.asarray(weights, dtype=np.float64)
    return float(np.max(w / w.sum() * np.asarray(times, dtype=np.float64)))


def predicted_gain(weights: Floats, target: Floats, times: Floats) -> float:
    """How much faster a step would be at ``target`` than at ``weights`` (0.1 = 10%)."""
    return step_time(weights, times) / step_time(target, times) - 1.0


class ThroughputController:
    """Smoothed per-item times in, per-rank weights out (see the module docstring)."""

    def __init__(self, world_size: int, settings: ControllerSettings) -> None:
        if world_size < 1:
            raise ValueError(f"a world of {world_size} ranks")
        self.world_size = world_size
        self.settings = settings
        self.weights = [1.0] * world_size
        self.smoothed: list[float] | None = None
        self.moving = False  # between a move's start and its settling (see SETTLE)
        self.updates = 0  # how often the weights changed

    def observe(self, times: Floats) -> bool:
        """One window's time per item of every rank; True when the weights changed. A window
        with a rank that measured nothing (no items, a zero or non-finite time) is ignored."""
        new = np.asarray(times, dtype=np.float64)
        if len(new) != self.world_size:
            raise ValueError(f"{len(new)} times for a world of {self.world_size} ranks")
        if not (np.all(np.isfinite(new)) and np.all(new > 0)):
            return False
        a = self.settings.smoothing
        smoothed = new if self.smoothed is None else a * new + (1 - a) * np.asarray(self.smoothed)
        self.smoothed = [float(x) for x in smoothed]
        if self.world_size == 1:
            return False
        weights = np.asarray(self.weights)
        target = target_weights(smoothed, self.settings.min_weight)
        gain = predicted_gain(weights, target, smoothed)
        # Two thresholds: start moving above the hysteresis, stop once within a quarter of it.
        if gain <= self.settings.hysteresis * (SETTLE if self.moving else 1.0):
            self.moving = False
            return False
        c = self.settings.max_change
        moved = self._normalized(weights * np.clip(target / weights, 1 / (1 + c), 1 + c))
        self.moving = True
        if np.allclose(moved, weights, rtol=1e-9, atol=0):
            return False
        self.weights = [float(x) for x in moved]
        self.updates += 1
        return True

    def _normalized(self, weights: np.ndarray) -> np.ndarray:
        """Mean 1, and no weight below the floor."""
        w = weights * (len(weights) / weights.sum())
        floor = self.settings.min_weight
        for _ in range(len(w)):
            if np.all(w >= floor * (1 - 1e-12)):
                break
            low = w < floor
            rest = len(w) - floor * int(low.sum())
            w = np.where(low, floor, w / w[~low].sum() * rest)
        return w

    # -- training state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "weights": list(self.weights),
            "smoothed": None if self.smoothed is None else list(self.smoothed),
            "moving": self.moving,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        weights = [float(w) for w in state["weights"]]
        if len(weights) != self.world_size:
            raise ValueError(f"{len(weights)} saved weights for a world of {self.world_size}")
        self.weights = weights
        smoothed = state.get("smoothed")
        self.smoothed = None if smoothed is None else [float(x) for x in smoothed]
        self.moving = bool(state.get("moving", False))
        self.updates = int(state.get("updates", 0))


# ---------------------------------------------------------------------------------------------
# Stragglers


@dataclass(frozen=True)
class StragglerEvent:
    rank: int
    state: str  # "slow": named a straggler; "recovered": no longer one
    slowdown: float  # time per item over the other ranks' median (mean over the slow steps)
    phase: str  # the phase whose excess over the others' median is largest: "data", "compute"
    steps: int  # steps it has been above the threshold (0 once recovered)


def median_of_others(values: Floats) -> np.ndarray:
    """For each rank, the median of the other ranks' values (with 2 ranks: the other's).

    One sort for all ranks: leaving out the value at sorted position p shifts the values
    above it down by one, so the others' k-th smallest is ``sorted[k]`` below p and
    ``sorted[k + 1]`` from p on. A median per rank of the other W - 1 values, each its own
    ``np.median``, cost O(W^2) on every rank every timing window (0.1 ms at 2 ranks, 4 ms at
    32 here). Where a value is not finite, each rank's median is taken on its own, as
    ``np.median`` propagates NaN."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    if n < 2 or not np.all(np.isfinite(v)):
        return np.array([np.median(np.delete(v, r)) for r in range(n)])
    order = np.argsort(v, kind="stable")
    ordered = v[order]
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)

    def kth_of_others(k: int) -> np.ndarray:
        # (ranks,): each rank's k-th smallest of the others' values.
        return np.where(k < position, ordered[k], ordered[min(k + 1, n - 1)])

    others = n - 1
    if others % 2:
        return kth_of_others(others // 2)
    return 0.5 * (kth_of_others(others // 2 - 1) + kth_of_others(others // 2))


def slowdowns(times: Floats) -> np.ndarray:
    """Each rank's time over the median of the other ranks' (1 in a world of one)."""
    t = np.asarray(times, dtype=np.float64)
    if len(t) < 2:
        return np.ones(len(t))
    with np.errstate(divide="ignore", invalid="ignore"):
        return t / median_of_others(t)


class StragglerDetector:
    """Names a rank whose time per item stays above ``threshold`` x the other ranks' median
    for at least ``window`` steps (consecutive windows), once, until it recovers."""

    def __init__(self, world_size: int, threshold: float, window: int) -> None:
        self.world_size = world_size
        self.threshold = threshold
        self.window = window
        self.slow_steps = [0] * world_size
        self.slow_sum = [0.0] * world_size  # slowdown x steps over the slow period
        self.named = [False] * world_size

    def observe(
        self, steps: int, per_item: Floats, data_per_item: Floats, compute_per_item: Floats
    ) -> list[StragglerEvent]:
        """One window of ``steps`` steps: each rank's time per item (what decides), and the
        same split into data and compute (what names the phase); the events it brings."""
        if self.world_size < 2 or steps <= 0:
            return []
        times = np.asarray(per_item, dtype=np.float64)
        data = np.asarray(data_per_item, dtype=np.float64)
        compute = np.asarray(compute_per_item, dtype=np.float64)
        if not all(np.all(np.isfinite(a)) for a in (times, data, compute)):
            return []
        factor = slowdowns(times)
        excess_data = data - median_of_others(data)
        excess_compute = compute - median_of_others(compute)
        events = []
        for rank in range(self.world_size):
            phase = "data" if excess_data[rank] > excess_compute[rank] else "compute"
            if factor[rank] > self.threshold:
                self.slow_steps[rank] += steps
                self.slow_sum[rank] += steps * float(factor[rank])
                if self.slow_steps[rank] >= self.window and not self.named[rank]:
                    self.named[rank] = True
                    mean = self.slow_sum[rank] / self.slow_steps[rank]
                    events.append(StragglerEvent(rank, "slow", mean, phase, self.slow_steps[rank]))
            else:
                self.slow_steps[rank] = 0
                self.slow_sum[rank] = 0.0
                if self.named[rank]:
                    self.named[rank] = False
                    events.append(StragglerEvent(rank, "recovered", float(factor[rank]), phase, 0))
        return events
