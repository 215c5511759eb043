"""The trainer's one seam to in-place recovery (``fault.recovery = "inplace"``).

The trainer knows recovery only as this protocol, called at a few points of its loop, as
torchft's loop calls its Manager at the start of a step and at its end; the concrete one is
:class:`dtrain.recovery.inplace.Recovery`, handed in by the in-place worker
(:mod:`dtrain.train.inplace_worker`), which runs one trainer per membership generation. Under
``fault.recovery = "restart"`` there is none (``Trainer.recovery is None``).

Where the loop calls it -- in the trainer's methods that dtrain's loop and a loop of the user's
own (:class:`dtrain.loop.run.Run`) both call, so the two recover alike::

    resume:               heal(trainer)        -- the state from a peer's memory, not a file
    the run log opens:    event()              -- this generation's membership, for the record
    each step starts:     step_starting(trainer)  (Trainer.next_batch)
    each step's sync:     joiner_waiting()     -- carried in the step's agreement (.regroup)
    the step after it:    regroup(step)        -- every rank leaves the generation (raises)
    an error:             recoverable(error)   -- the survivors go on, no diagnosis to wait for
"""

from __future__ import annotations

from typing import Any, NoReturn, Protocol


class RecoverySeam(Protocol):
    def heal(self, trainer: Any) -> bool:
        """Load the trainer's state from the generation's handover, when it has one (True)."""

    def event(self) -> dict[str, Any] | None:
        """This generation's membership, as the run log records it."""

    def step_starting(self, trainer: Any) -> None:
        """A step begins: keep what a handover would need."""

    def joiner_waiting(self) -> bool:
        """Whether a worker waits to join (the ranks agree on it in the step's sync)."""

    def regroup(self, step: int) -> NoReturn:
        """Leave this generation after ``step``, on every rank, to admit the joiner."""

    def recoverable(self, error: BaseException) -> bool:
        """Whether ``error`` ends only this generation (the survivors go on)."""
