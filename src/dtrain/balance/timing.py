"""Each rank's time per step, split into phases, and the gather that brings every rank's to all.

A step on one rank, as :class:`StepTimer` splits it (``time.perf_counter``)::

    start ── data ──► data_ready ── comm + compute + optimizer ──► finish
             next(loader), the batch to the device
                                   comm:      time waited on communication, from the strategy's
                                              counter (dtrain.comm.accounting): the step's item-
                                              count all-reduce and the gradient sync
                                   optimizer: optimizer.step() (timed by the optimizer's hooks)
                                   compute:   the rest: forward, backward, clipping

A rank's *time per item*, ``(data + compute) / items``, is its own speed whatever its share and
however long it waited for the others (a wait shows as ``comm``); a window reports the median
over its steps. The sums of a window are exchanged in one small all-gather
(:func:`start_gather_windows`) started after a window's last backward and taken at its end, so
it overlaps the optimizer step, and every rank receives the same numbers: every rank's
controller makes the same decision at the same step without another collective. The phases,
the window's length and the costs: docs/load-balancing.md, "What is measured".
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dtrain.comm.accounting import CommCounter
from dtrain.comm.plain import all_gather_json
from dtrain.metrics.hardware import memory_bytes

# What a rank sums over a window of steps, in this order (one row per rank once gathered).
FIELDS = (
    "steps",
    "data_s",
    "compute_s",
    "comm_s",
    "optimizer_s",
    "step_s",
    "items",
    "samples",
    "micro_steps",
    "time_per_item_s",  # not a sum: the median over the window's steps
    "memory_bytes",  # not a sum: this rank's memory at the window's end (metrics.hardware)
)
INDEX = {name: i for i, name in enumerate(FIELDS)}


class StepTimer:
    """This rank's phase times, summed over the steps since the last :meth:`take`."""

    def __init__(
        self,
        comm: CommCounter,
        optimizer: torch.optim.Optimizer | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.comm = comm
        self.device = device or torch.device("cpu")  # whose memory a window reports
        # The window's sums of FIELDS up to micro_steps, as Python floats: adding a step's row
        # into a NumPy array cost more than the step's timing itself.
        self._sums = [0.0] * INDEX["time_per_item_s"]
        self._per_item: list[float] = []  # each step's (data + compute) / items in the window
        self._start = 0.0
        self._ready = 0.0
        self._comm_start = 0.0
        self._optimizer_s = 0.0
        self._optimizer_began = 0.0
        self._counts = (0, 0, 0)  # items, samples, micro-steps of the step being timed
        self.last: dict[str, float] = {}  # the phases of the last step finished
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._optimizer_begins)
            optimizer.register_step_post_hook(self._optimizer_ends)

    def _optimizer_begins(self, *_: Any) -> None:
        self._optimizer_began = time.perf_counter()

    def _optimizer_ends(self, *_: Any) -> None:
        self._optimizer_s += time.perf_counter() - self._optimizer_began

    def start(self) -> None:
        """The step begins (before the loader is asked for its batch)."""
        self._start = time.perf_counter()
        self._optimizer_s = 0.0

    def data_ready(self, items: int, samples: int, micro_steps: int) -> None:
        """The step's batch is on the device; what it holds on this rank."""
        self._ready = time.perf_counter()
        self._comm_start = self.comm.wait_s
        self._counts = (items, samples, micro_steps)

    def finish(self) -> None:
        """The step's update is done: add its phases to the window (and :attr:`last`)."""
        end = time.perf_counter()
        data = self._ready - self._start
        comm = max(0.0, self.comm.wait_s - self._comm_start)
        optimizer = self._optimizer_s
        compute = max(0.0, end - self._ready - comm - optimizer)
        items, samples, micro_steps = self._counts
        per_item = (data + compute) / items if items > 0 else float("nan")
        row = (1, data, compute, comm, optimizer, end - self._start, items, samples, micro_steps)
        self._sums = [total + value for total, value in zip(self._sums, row)]
        if items > 0:
            self._per_item.append(per_item)
        self.last = dict(zip(FIELDS, (*row, per_item)))

    def take(self) -> np.ndarray:
        """The window's sums and median time per item (a copy); the next window starts
        empty."""
        median = float(np.median(self._per_item)) if self._per_item else float("nan")
        window = np.array([*self._sums, median, memory_bytes(self.device)], dtype=np.float64)
        self._sums = [0.0] * len(self._sums)
        self._per_item.clear()
        return window


MAX_WINDOW_STEPS = 1000  # steps per timing window at most, however fast they are


def window_steps(rows: np.ndarray, every: int, window_s: float) -> int:
    """Steps from a gather of ``rows`` (every rank's window) to the next: ``every``
    (``balance.every``), or more where that many steps take less than ``window_s``
    (``balance.window_s``) at the windows' mean step time, at most :data:`MAX_WINDOW_STEPS`.

    A gather and its records cost a rank a collective, a median and the records: every few
    steps of a short step that is felt, once a second it is nothing. Computed from the
    gathered rows, which every rank holds alike, so every rank picks the same next step
    without another word."""
    steps = float(rows[:, INDEX["steps"]].sum())
    mean_step_s = float(rows[:, INDEX["step_s"]].sum()) / steps if steps > 0 else 0.0
    if window_s <= 0 or mean_step_s <= 0:
        return every
    return max(every, min(MAX_WINDOW_STEPS, int(window_s / mean_step_s)))


def start_gather_windows(
    window: np.ndarray, world_size: int, comm: CommCounter, device: torch.device
) -> Callable[[], np.ndarray]:
    """Collective: start gathering every rank's window; call what it returns for the result,
    ``(ranks, len(FIELDS))``, the same on every rank. Counted in ``comm`` like the strategy's
    collectives (bytes sent; time waited, from the call that takes the result). On ``device``:
    the job's backend may have no CPU collectives (NCCL)."""
    if world_size < 2:
        alone = window.reshape(1, -1).copy()
        return lambda: alone
    mine = torch.tensor(window, dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    work = dist.all_gather(parts, mine, async_op=True)
    comm.all_gather(mine.numel() * mine.element_size(), world_size)

    def result() -> np.ndarray:
        with comm.waiting():
            if work is not None:
                work.wait()
            return torch.stack(parts).cpu().numpy()

    return result


def gather_hosts(world_size: int) -> list[str]:
    """Collective: every rank's host name (``socket.gethostname()``), in rank order; once, at
    start."""
    mine = socket.gethostname()
    if world_size < 2:
        return [mine]
    return [str(h) for h in all_gather_json(mine)]
