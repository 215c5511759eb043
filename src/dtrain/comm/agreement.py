"""What the ranks agree on about each training step: its global item count (the loss scale's
denominator) and whether any rank was asked to stop (preemption), summed over every rank once
per step.

The sum rides in the gradient all-reduce of the step's last bucket where the comm hook can
carry it (:meth:`dtrain.comm.hooks.CommHook.carry`): packed as a few float32 values, exact
integers, appended to the bucket. Otherwise it is one small all-reduce of its own
(:meth:`StepAgreement.all_reduce`). How the trainer uses it: :mod:`dtrain.train.step`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtrain.comm.accounting import CommCounter

# An item count travels as digits of a few bits each, one float32 value per digit: summed over
# every rank, a digit stays an exact integer while W x (largest digit) <= 2**24 (float32's
# significant bits). Digits of 12 bits carry up to 4,097 ranks; more ranks get narrower digits
# (and more of them), down to 1 bit at 2**24 - 1 ranks, the most a float32 sum can count
# exactly: far above any job. Counts up to 2**36 per rank and step.
_EXACT = 1 << 24
_COUNT_BITS = 36
MAX_CARRYING_RANKS = _EXACT - 1


def _digit_bits(world: int) -> int:
    """The widest digit (at most 12 bits) whose sum over ``world`` ranks is exact."""
    bits = 12
    while bits > 1 and world * ((1 << bits) - 1) > _EXACT:
        bits -= 1
    return bits


class StepAgreement:
    """This rank's item count and stop flag for a step, and, once summed over every rank, the
    step's global count and whether any rank was asked to stop.

    Summed once per step by whoever gets to it: a comm hook that carries it with the
    gradients (:meth:`pack`, then :meth:`unpack` of the sums), or :meth:`all_reduce`."""

    # Values when packed: the count's digits, then the flags. Up to 4,095 ranks the flags share
    # one value, stop + (W + 1) x regroup: summed over W ranks (at most W(W + 2) < 2**24), the
    # stops and the regroups come apart exactly, and a job that never regroups sends what it
    # sent before. More ranks send the two flags as two values.

    def __init__(
        self, items: int, stop: bool, regroup: bool = False, *, world: int | None = None
    ) -> None:
        if items < 0 or items >= 1 << _COUNT_BITS:
            raise ValueError(f"a step's item count on one rank must be in [0, 2**36): {items}")
        self.local = (items, stop)
        # fault.recovery = 'inplace': a worker waits to join, every rank leaves this
        # membership generation after the step (dtrain.recovery.inplace).
        self.local_regroup = regroup
        if world is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
        self.world = world
        self._bits = _digit_bits(world)
        self._digits = -(-_COUNT_BITS // self._bits)
        self._one_flag = world * (world + 2) < _EXACT
        self.items = 0  # the sums, once agreed
        self.stop = False
        self.regroup = False
        self.agreed = False

    @property
    def width(self) -> int:
        """How many values :meth:`pack` gives (the same on every rank: it depends on W)."""
        return self._digits + (1 if self._one_flag else 2)

    def _flags(self) -> float:
        return float(self.local[1]) + float(self.local_regroup) * (self.world + 1)

    def _take_flags(self, total: float) -> None:
        stops, regroups = int(total) % (self.world + 1), int(total) // (self.world + 1)
        self.stop, self.regroup = stops > 0, regroups > 0

    def pack(self) -> list[float]:
        items, mask = self.local[0], (1 << self._bits) - 1
        digits = [float((items >> (self._bits * i)) & mask) for i in range(self._digits)]
        if self._one_flag:
            return [*digits, self._flags()]
        return [*digits, float(self.local[1]), float(self.local_regroup)]

    def unpack(self, sums: Sequence[float]) -> None:
        """Take the sums of every rank's :meth:`pack` (exact: see ``MAX_CARRYING_RANKS``)."""
        n = self._digits
        self.items = sum(int(sums[i]) << (self._bits * i) for i in range(n))
        if self._one_flag:
            self._take_flags(sums[n])
        else:
            self.stop, self.regroup = int(sums[n]) > 0, int(sums[n + 1]) > 0
        self.agreed = True

    def all_reduce(self, comm: CommCounter, device: torch.device) -> None:
        """Agree in one small all-reduce over every rank (whatever groups the strategy uses)."""
        items, stop = self.local
        if self.world == 1:
            self.items, self.stop, self.agreed = items, stop, True
            self.regroup = self.local_regroup
            return
        sums = torch.tensor([items, self._flags()], dtype=torch.float64, device=device)
        with comm.waiting():
            dist.all_reduce(sums)
        comm.all_reduce(sums.numel() * sums.element_size(), self.world)
        self.items, self.agreed = int(sums[0]), True
        self._take_flags(float(sums[1]))
