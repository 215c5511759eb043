"""The NaN guard: a step whose global gradient norm is not finite skips its update on every rank
(the norm is global, so every rank takes the same branch without another collective); after
``fault.nan_rollback_after`` in a row the run rolls back, never to deliver their batches again.
Under fp16-mixed an overflow of the loss scale (every rank's loss finite, the scale above its
floor) is the scaler's, not the guard's (docs/fault-tolerance.md, "NaN guard").

The guard only decides (:class:`Decision`); the trainer carries the decision out: it counts
the skip, writes the events, and rolls back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Action = Literal["continue", "overflow", "skip", "rollback"]


@dataclass(frozen=True)
class Decision:
    """What the trainer does after a committed step (the same on every rank)."""

    action: Action
    in_a_row: int = 0  # skip, rollback: the non-finite steps in a row, this one included
    # rollback: load the newest checkpoint before step ``first_bad``, and never deliver the
    # stream ranges ``bad`` (the streak's batches) again.
    first_bad: int = 0
    bad: tuple[tuple[int, int], ...] = ()


CONTINUE = Decision("continue")
OVERFLOW = Decision("overflow")


class NanGuard:
    """See the module docstring. It holds the streak only: the counters of skips and rollbacks
    are the trainer's (part of its training state)."""

    def __init__(self, rollback_after: int) -> None:
        self.rollback_after = rollback_after  # fault.nan_rollback_after; 0: never roll back
        self.streak: list[tuple[int, int]] = []  # stream ranges of consecutive bad steps

    def decide(self, step: int, norm: float, overflowed: bool, span: tuple[int, int]) -> Decision:
        """Step ``step`` (its batch the stream range ``span``) is committed with the global
        gradient norm ``norm``: a finite norm ends a streak; an overflow of fp16's loss scale is
        the scaler's; any other non-finite norm skips the step, and the Nth in a row rolls
        back."""
        if math.isfinite(norm):
            self.streak.clear()
            return CONTINUE
        if overflowed:
            return OVERFLOW
        self.streak.append(span)
        in_a_row = len(self.streak)
        if not self.rollback_after or in_a_row < self.rollback_after:
            return Decision("skip", in_a_row)
        bad = tuple(self.streak)
        self.streak.clear()
        return Decision("rollback", in_a_row, first_bad=step - in_a_row + 1, bad=bad)
