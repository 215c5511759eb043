"""Preemption: a signal asks every rank to save at the next step boundary and exit 0.

The handler only sets a flag -- no file I/O, no collectives, nothing that could deadlock inside
a signal handler. The trainer folds the flag into the step's agreement
(:class:`~dtrain.comm.agreement.StepAgreement`), which every step sums over the ranks with its
gradient sync, so the ranks agree on the same step without a collective of its own: a signal
that reaches only one rank (or only the launcher, which forwards it) still stops all of them
together, after the same step's update.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any


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
