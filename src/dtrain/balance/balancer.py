"""Load balancing: per-rank timing, straggler reports and the throughput controller. It takes
its own config section (``[balance]``), the world and the step timings
(:class:`~dtrain.balance.timing.StepTimer`, which the wiring hooks to the optimizer), and
returns records and per-rank weights: the trainer writes the records and hands the weights to
its loader. Its state (the controller: weights and smoothed times) is a part of the training
state (``balance`` in ``train_state.pt``).

The trainer calls, on every rank, in every step::

    balancer.step_started()                     before the loader is asked for the batch
    balancer.data_ready(batch, items)           the batch is on the device
    balancer.backward_done(step)                after backward; on a window's last step:
                                                start all-gathering every rank's timing
                                                window (the steps before this one)
    outcome = balancer.step_finished(step)      after the update; on a window's last step:
                                                the gathered windows, a "ranks" record,
                                                straggler events, and with
                                                balance.mode = "throughput" new weights for
                                                the loader from the next step on

Every rank runs the same controller on the same gathered numbers, so every rank gets the same
weights after the same step, and picks the same step for the next gather (the window's length
comes from the gathered mean step time): no collective of its own. The records' fields and the
windows: docs/load-balancing.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dtrain.balance.throughput import (
    ControllerSettings,
    StragglerDetector,
    StragglerEvent,
    ThroughputController,
    slowdowns,
)
from dtrain.balance.timing import (
    INDEX,
    StepTimer,
    gather_hosts,
    start_gather_windows,
    window_steps,
)
from dtrain.comm.accounting import CommCounter
from dtrain.config import BalanceConfig
from dtrain.data.loader import StepBatch
from dtrain.dist.runtime import Runtime
from dtrain.fault.failpoints import failpoint

Record = dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What a step's end gives the trainer: the records to write (rank 0 writes them), and the
    per-rank weights the loader cuts every batch by from the next step on, when they changed."""

    records: list[Record] = field(default_factory=list)
    weights: list[float] | None = None


NOTHING = Outcome()


def loader_weights(weights: Sequence[float]) -> list[float] | None:
    """``weights`` as the loader takes them: None for equal shares (the unweighted cut)."""
    return None if all(w == 1.0 for w in weights) else list(weights)


class LoadBalancer:
    """See the module docstring. ``data_parallel_size``: the ranks that share a global batch
    (all of them under ``balance.mode = "throughput"``, a rule of the config package's)."""

    def __init__(
        self,
        opts: BalanceConfig,
        runtime: Runtime,
        data_parallel_size: int,
        timer: StepTimer,
        comm: CommCounter,
        log: Callable[[str], None],
        item_name: str = "items",
    ) -> None:
        self.every = opts.every
        self.window_s = opts.window_s
        self._next_gather: int | None = None  # the step whose backward starts the next gather
        self._gathering: Callable[[], np.ndarray] | None = None  # a window's gather in flight
        self.world_size = runtime.world_size
        self.writes_records = runtime.is_main  # the records are rank 0's to write
        self.device = runtime.device
        self.shares = data_parallel_size  # how many weights
        self.comm = comm
        self.log = log
        self.item_name = item_name
        self.hosts = gather_hosts(runtime.world_size)
        self.timer = timer
        self.detector = StragglerDetector(
            runtime.world_size, opts.straggler_threshold, opts.straggler_window
        )
        self.controller: ThroughputController | None = None
        if opts.mode == "throughput":
            settings = ControllerSettings(
                opts.smoothing, opts.max_change, opts.hysteresis, opts.min_weight
            )
            self.controller = ThroughputController(data_parallel_size, settings)

    # -- the step ------------------------------------------------------------------------

    def step_started(self) -> None:
        self.timer.start()

    def data_ready(self, batch: StepBatch, items: int) -> None:
        """The step has its batch; ``items`` on this rank."""
        self.timer.data_ready(items, sum(len(ids) for ids in batch.ids), len(batch.micro))

    def backward_done(self, step: int) -> None:
        """Step ``step``'s backward is done. Collective on a window's last step
        (:func:`~dtrain.balance.timing.window_steps`): start gathering the window -- the steps
        finished since the last one, i.e. up to step - 1 (this step's update is not timed yet;
        it opens the next window). Started here, when the gradient all-reduce has just
        brought the ranks together, the gather completes while they run their optimizer
        steps; :meth:`step_finished` takes the result."""
        if self._next_gather is None:
            # The first window after a start or a resume ends on a multiple of balance.every.
            self._next_gather = -(-step // self.every) * self.every
        if step < self._next_gather:
            return
        window = self.timer.take()
        # Tests replace the measured window here to make the controller's input exact.
        failpoint("balance.timing", step=step, window=window)
        self._gathering = start_gather_windows(window, self.world_size, self.comm, self.device)

    def step_finished(self, step: int) -> Outcome:
        """After step ``step``'s update. On a window's last step, the window whose gather
        :meth:`backward_done` started: the metrics records to write, and the controller's new
        weights, which hold from the next step on."""
        self.timer.finish()
        if self._gathering is None:
            return NOTHING
        gathering, self._gathering = self._gathering, None
        rows = gathering()
        self._next_gather = step + window_steps(rows, self.every, self.window_s)
        return self._on_window(step, rows)

    def _on_window(self, step: int, rows: np.ndarray) -> Outcome:
        steps = rows[:, INDEX["steps"]]
        if np.any(steps <= 0):
            return NOTHING  # nothing timed since the last window (a resume on a window boundary)
        items = rows[:, INDEX["items"]]
        with np.errstate(divide="ignore", invalid="ignore"):
            data_per_item = rows[:, INDEX["data_s"]] / items
            compute_per_item = rows[:, INDEX["compute_s"]] / items
        per_item = rows[:, INDEX["time_per_item_s"]]  # each rank's median over the window
        # The ranks record holds W entries a field: built where it is written, once a window,
        # not on every rank (where it cost O(W) each window, for nothing).
        records: list[Record] = [self._ranks_record(step, rows)] if self.writes_records else []
        events = self.detector.observe(int(steps[0]), per_item, data_per_item, compute_per_item)
        records += [self._on_straggler(step, event.rank, event) for event in events]
        if self.controller is not None and self.controller.observe(per_item):
            records.append(self._new_weights(step))
            return Outcome(records, self.weights)
        return Outcome(records)

    def _ranks_record(self, step: int, rows: np.ndarray) -> Record:
        steps = rows[:, INDEX["steps"]]
        per_step = rows / steps[:, None]
        samples = per_step[:, INDEX["samples"]]
        per_item = rows[:, INDEX["time_per_item_s"]]
        return {
            "kind": "ranks",
            "step": step,
            "steps": int(steps[0]),
            "hosts": self.hosts,
            **{
                name: _floats(per_step[:, INDEX[name]])
                for name in ("data_s", "compute_s", "comm_s", "optimizer_s", "step_s")
            },
            "samples": _floats(samples),
            "items": _floats(per_step[:, INDEX["items"]]),
            "micro_steps": _floats(per_step[:, INDEX["micro_steps"]]),
            "share": _floats(samples / samples.sum()),
            "weight": list(self.weights),
            "time_per_item_s": _floats(per_item),
            "slowdown": _floats(slowdowns(per_item)),
            "memory_bytes": _floats(rows[:, INDEX["memory_bytes"]]),
            "time": time.time(),
        }

    def _on_straggler(self, step: int, rank: int, event: StragglerEvent) -> Record:
        host = self.hosts[rank]
        if event.state == "slow":
            self.log(
                f"straggler: rank {rank} on {host}: {event.slowdown:.1f}x slower than median, "
                f"{event.phase}-bound (time per {_singular(self.item_name)}, data + compute, "
                f"against the other ranks' median over the last {event.steps} steps)"
            )
        else:
            self.log(
                f"rank {rank} on {host} is no longer a straggler ({event.slowdown:.2f}x the median)"
            )
        return {
            "kind": "straggler",
            "step": step,
            "rank": rank,
            "host": host,
            "state": event.state,
            "slowdown": event.slowdown,
            "phase": event.phase,
            "steps": event.steps,
            "time": time.time(),
        }

    def _new_weights(self, step: int) -> Record:
        """New weights from the controller, for every batch from the next on (the same step on
        every rank: they all saw the same window): said in the log and as a record."""
        weights = self.weights
        shares = np.asarray(weights) / sum(weights)
        self.log(
            f"step {step}: load balancing: shares of the global batch now "
            + ", ".join(f"{100 * s:.1f}%" for s in shares)
            + " (rank 0 first)"
        )
        return {
            "kind": "balance",
            "step": step,
            "weight": list(weights),
            "share": _floats(shares),
            "time": time.time(),
        }

    @property
    def weights(self) -> list[float]:
        """The per-rank weights in effect (equal without a controller)."""
        if self.controller is None:
            return [1.0] * self.shares
        return list(self.controller.weights)

    # -- training state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.shares,
            "controller": None if self.controller is None else self.controller.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the controller (weights and smoothed times) when it was saved by a run at
        the same data-parallel size with balancing on; else start from equal shares. The
        trainer hands the loader the weights then in effect (:attr:`weights`)."""
        if self.controller is None:
            return
        saved = state.get("controller")
        if saved is not None and state.get("world_size") == self.shares:
            self.controller.load_state_dict(saved)
        else:
            self.controller = ThroughputController(self.shares, self.controller.settings)
            if saved is not None:
                self.log(
                    f"load balancing starts from equal shares: the checkpoint's weights are for "
                    f"{state.get('world_size')} ranks, this run has {self.shares}"
                )


def _floats(values: np.ndarray) -> list[float | None]:
    # tolist() first: a NumPy scalar's float() and isfinite() cost ~1 us each, W of them a
    # field of every ranks record.
    return [v if math.isfinite(v) else None for v in values.tolist()]


def _singular(item_name: str) -> str:
    return item_name[:-1] if item_name.endswith("s") else item_name
