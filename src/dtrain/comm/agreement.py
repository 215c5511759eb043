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

# An item count travels as _LIMBS digits of _LIMB_BITS bits: sums of such digits over up to
# 2**(24 - _LIMB_BITS) ranks are exact in float32 (24 significant bits), so the agreement can
# ride in a float32 gradient bucket. Counts up to 2**36 per rank and step.
_LIMB_BITS = 12
_LIMBS = 3
_RADIX = 1 << _LIMB_BITS
# The flags' sum, at most W(W + 2), stays below 2**24 as well.
MAX_CARRYING_RANKS = (1 << (24 - _LIMB_BITS)) - 2


class StepAgreement:
    """This rank's item count and stop flag for a step, and, once summed over every rank, the
    step's global count and whether any rank was asked to stop.

    Summed once per step by whoever gets to it: a comm hook that carries it with the
    gradients (:meth:`pack`, then :meth:`unpack` of the sums), or :meth:`all_reduce`."""

    # Values when packed: the count's digits, then the flags. The flags share one value,
    # stop + (W + 1) x regroup: summed over W ranks, the stops (at most W) and the regroups
    # come apart exactly, and a job that never regroups sends what it sent before.
    WIDTH = _LIMBS + 1

    def __init__(self, items: int, stop: bool, regroup: bool = False) -> None:
        if items < 0 or items >= _RADIX**_LIMBS:
            raise ValueError(f"a step's item count on one rank must be in [0, 2**36): {items}")
        self.local = (items, stop)
        # fault.recovery = 'inplace': a worker waits to join, every rank leaves this
        # membership generation after the step (dtrain.recovery.inplace).
        self.local_regroup = regroup
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.items = 0  # the sums, once agreed
        self.stop = False
        self.regroup = False
        self.agreed = False

    def _flags(self) -> float:
        return float(self.local[1]) + float(self.local_regroup) * (self.world + 1)

    def _take_flags(self, total: float) -> None:
        stops, regroups = int(total) % (self.world + 1), int(total) // (self.world + 1)
        self.stop, self.regroup = stops > 0, regroups > 0

    def pack(self) -> list[float]:
        items = self.local[0]
        digits = [float((items >> (_LIMB_BITS * i)) & (_RADIX - 1)) for i in range(_LIMBS)]
        return [*digits, self._flags()]

    def unpack(self, sums: Sequence[float]) -> None:
        """Take the sums of every rank's :meth:`pack` (exact: see ``MAX_CARRYING_RANKS``)."""
        self.items = sum(int(sums[i]) << (_LIMB_BITS * i) for i in range(_LIMBS))
        self._take_flags(sums[_LIMBS])
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
