"""Preemption: a signal asks every rank to save at the next step boundary and exit 0.

The handler only sets a flag -- no file I/O, no collectives, nothing that could deadlock inside
a signal handler. The trainer folds the flag into the small all-reduce it makes at the start of
each step to count the step's items, so the ranks agree on the same step without an extra
collective: a signal that reaches only one rank (or only the launcher, which forwards it) still
stops all of them together.

A task that declares ``Task.items_per_sample`` has no such all-reduce: every rank knows a step's
count from its plan. Its ranks agree on the flag in a collective of its own, after the steps
:class:`StopChecks` picks: about every ``fault.preempt_check_s`` seconds, so that a step of a
few milliseconds does not pay a collective's fixed cost (about 0.3 ms of CPU on gloo) for a
flag that is almost never set.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from dtrain.comm.accounting import CommCounter


class PreemptionFlag:
    def __init__(self, signal_names: Sequence[str]) -> None:
        self.signum: int = 0
        self._previous: dict[int, Any] = {}
        for name in signal_names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class StopChecks:
    """The steps after which the ranks agree on the preemption flag, when no per-step collective
    carries it: the first step of a run, then about every ``interval_s`` seconds. The spacing
    comes from the mean step time the ranks agree on at each check, so every rank picks the same
    steps without another word; ``interval_s = 0`` checks after every step."""

    MAX_EVERY = 1000  # steps between checks at most, however fast they are

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.next_step = 0  # check after the first step this process trains
        self.last_step = 0  # the step of the last check (0: none yet)
        self._mark = (0, time.perf_counter())  # (step, time) the next mean step time runs from

    def start(self, step: int) -> None:
        """Training starts (or resumes) after ``step``: the first mean step time runs from now."""
        self._mark = (step, time.perf_counter())

    def agree(
        self, step: int, requested: bool, comm: CommCounter, device: torch.device, world: int
    ) -> bool:
        """Collective, over every rank, after a step :meth:`due` picked: whether any rank was
        asked to stop, in one small all-reduce that also agrees on the mean step time that
        spaces the next check."""
        mark_step, mark_time = self._mark
        now = time.perf_counter()
        # Whole microseconds: their sum is exact, so every rank computes the same spacing.
        step_us = round(1e6 * (now - mark_time) / max(1, step - mark_step))
        agreed = torch.tensor(
            [float(requested), float(step_us)], dtype=torch.float64, device=device
        )
        if world > 1 and dist.is_initialized():
            with comm.waiting():
                dist.all_reduce(agreed)  # every rank, whatever groups the strategy uses
            comm.all_reduce(agreed.numel() * agreed.element_size(), world)
        self.checked(step, float(agreed[1]) / world / 1e6)
        self._mark = (step, now)
        return bool(agreed[0] > 0)

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def checked(self, step: int, mean_step_s: float) -> None:
        """A check after ``step`` agreed on ``mean_step_s`` (the same on every rank): when the
        next one falls."""
        every = 1
        if self.interval_s > 0 and mean_step_s > 0:
            every = max(1, min(self.MAX_EVERY, int(self.interval_s / mean_step_s)))
        self.last_step, self.next_step = step, step + every
