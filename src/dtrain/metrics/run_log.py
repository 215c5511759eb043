"""What a run writes, for the trainer: the run's status, its records (the start record, events,
train and eval records, the summary record) to rank 0's sinks (metrics.jsonl, the progress
line, TensorBoard, the experiment trackers), and its log lines. docs/metrics.md describes every
record.

Every rank keeps its own communication counters (the train record's bytes and waiting time
since the last line); rank 0 writes, and the others only count and warn.
"""

from __future__ import annotations

import time
from typing import Any

from dtrain.config import Config
from dtrain.dist.runtime import Runtime
from dtrain.fault.status import RunStatus, write_status
from dtrain.fsutil import local_run_dir
from dtrain.metrics import records
from dtrain.metrics.hardware import describe, memory_kind
from dtrain.metrics.records import Record
from dtrain.metrics.sinks import Progress, Sinks, open_sinks
from dtrain.metrics.summary import Summary
from dtrain.metrics.trackers import open_trackers
from dtrain.parallel.base import Strategy

# The summary record's numbers, each the Summary's field of that name (docs/metrics.md).
SUMMARY_FIELDS = ("wall_s", "train_loss", "val_loss", "skipped_steps", "rollbacks", "comm_bytes",
                  "comm_wait_s")  # fmt: skip


class RunLog:
    """The trainer's one way to say what happened; see the module docstring."""

    def __init__(self, cfg: Config, runtime: Runtime, strategy: Strategy, item_name: str) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.strategy = strategy
        self.item_name = item_name
        self.run_dir = local_run_dir(cfg.run.dir, cfg.run.local_dir)  # this machine's
        self.is_main = runtime.is_main
        self.progress: Progress | None = None
        self.metrics: Sinks | None = None  # rank 0's, from open() on
        # run.init_from's weights in words (a run folder's checkpoint named), once loaded
        self.init_from = cfg.run.init_from
        # This rank's communication totals at the last train record; set-up's (the broadcast
        # of rank 0's parameters) belongs to no step.
        self._comm_mark = strategy.comm.totals()
        # This rank's parameter bytes, for the start and train records (sizes do not change).
        self.param_bytes = strategy.parameter_bytes()
        # A sharded strategy's counters cover only part of its communication: not reported.
        self.comm_counted = not strategy.capabilities.sharded_state

    def where(self) -> str:
        """The run folder, and this machine's folder where the run folder is in a store."""
        if str(self.run_dir) == self.cfg.run.dir:
            return self.cfg.run.dir
        return f"{self.cfg.run.dir} (this machine's records: {self.run_dir})"

    # -- lines ---------------------------------------------------------------------------

    def log(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        elif self.is_main:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        """A warning from any rank (not only rank 0), tagged with the rank."""
        if self.is_main:
            self.log(f"warning: {text}")
        else:
            print(f"[rank {self.runtime.rank}] warning: {text}", flush=True)

    # -- records -------------------------------------------------------------------------

    def open(
        self,
        step: int,
        hosts: list[str],
        resumed_from: str | None,
        membership: dict[str, Any] | None,
        in_place: bool,
    ) -> None:
        """The start of training at ``step``: the status 'running', the sinks, the start
        record, the events of how the run got here (a restart, a resume from the checkpoint
        ``resumed_from``, a new membership with ``in_place`` recovery) and the start line.
        Collective (the restart count)."""
        attempt = records.group_restart_attempt(self.runtime)  # a collective: every rank
        if not self.is_main:
            return
        cfg = self.cfg
        write_status(self.run_dir, RunStatus("running", step))
        self.progress = Progress(cfg.train.steps, step, self.item_name)
        # A run that goes on from where one stopped (a resume, a restart, a new membership)
        # goes on with its tracker runs too.
        continuing = step > 0 or attempt > 0 or membership is not None
        self.metrics = open_sinks(
            self.run_dir,
            self.progress,
            tensorboard=cfg.metrics.tensorboard,
            trackers=open_trackers(cfg, continuing),
        )
        device = self.runtime.device
        start = {  # what this attempt runs, and on what (rank 0's machine)
            "kind": "start",
            "step": step,
            "steps": cfg.train.steps,
            "attempt": attempt,
            "world_size": self.runtime.world_size,
            "data_parallel_size": self.strategy.data_parallel_size,
            "strategy": self.strategy.name,
            "item_name": self.item_name,
            "global_batch_size": cfg.data.global_batch_size,
            "hosts": hosts,
            "param_bytes_rank0": self.param_bytes,
            "memory_kind": memory_kind(device),
            "hardware": describe(device),
            "time": time.time(),
        }
        init_from = cfg.run.init_from if not resumed_from else ""  # a resume reads its own
        if init_from:
            start["init_from"] = init_from
        self.metrics.write(start)
        if attempt and not in_place:  # in place: a membership event instead
            self.event("restart", step, attempt=attempt)
        if resumed_from is not None:
            self.event("resumed", step, checkpoint=resumed_from)
        if membership is not None:
            self.event("membership", step, **membership)
        where = f"resumed from {resumed_from}" if resumed_from else "from scratch"
        if init_from:
            where = f"from the weights in {self.init_from or init_from} (run.init_from)"
        if membership is not None:
            where = f"healed from member {membership['healed_from']}'s memory"
        self.log(
            f"dtrain: training {self.strategy.name} on {self.runtime.world_size} "
            f"rank(s), {self.runtime.device.type}, {where}; run folder {self.where()}"
        )

    def event(self, name: str, step: int, **fields: Any) -> None:
        """An event record (docs/metrics.md) at ``step``; rank 0 writes it."""
        if self.metrics is not None:
            self.metrics.write(records.event(name, step, **fields))

    def write_records(self, written: list[Record]) -> None:
        if self.metrics is not None:
            for record in written:
                self.metrics.write(record)

    def train(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        rate: float,
        steps: int,
        elapsed: float,
        *,
        lr: float,
        epoch: float,
        items_seen: int,
        skipped_steps: int,
    ) -> None:
        """The train record (docs/metrics.md) of the ``steps`` steps up to ``step`` (every
        rank: it counts); communication is None where the strategy cannot count all of it."""
        # This rank's communication since the last line (every rank counts its own; rank 0's
        # is logged: data-parallel ranks send alike).
        total_sent, total_waited = self.strategy.comm.totals()
        sent, waited = total_sent - self._comm_mark[0], total_waited - self._comm_mark[1]
        self._comm_mark = (total_sent, total_waited)
        if not self.is_main:
            return
        assert self.metrics is not None
        per_step = max(1, steps)
        comm: dict[str, float | None] = {"comm_bytes_per_step": None, "comm_wait_s_per_step": None}
        if self.comm_counted:
            comm = {
                "comm_bytes_per_step": sent / per_step,
                "comm_wait_s_per_step": waited / per_step,
                "comm_wait_share": waited / elapsed if elapsed > 0 else 0.0,
            }
        global_batch = self.cfg.data.global_batch_size
        record = {
            "kind": "train",
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            f"{self.item_name}_per_s": rate,
            # Every step holds the global batch's samples, whatever the items are.
            "samples_per_s": steps * global_batch / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed / per_step,
            "epoch": epoch,
            "items_seen": items_seen,
            "skipped_steps": skipped_steps,
            "param_bytes_rank0": self.param_bytes,
            **comm,
            "time": time.time(),
        }
        self.metrics.write(record)  # the progress line is one of the sinks

    def evaluated(self, step: int, loss: float, items: int, metrics: dict[str, float]) -> None:
        """An evaluation's record and line: its mean loss over ``items``, the task's
        ``metrics``; rank 0's."""
        if not self.is_main:
            return
        assert self.metrics is not None
        named = {f"val_{name}": value for name, value in metrics.items()}  # Task.metrics
        record = {"kind": "eval", "step": step, "val_loss": loss, "val_items": items, **named}
        self.metrics.write({**record, "time": time.time()})
        extra = "".join(f", {name} {value:.4f}" for name, value in metrics.items())
        self.log(f"step {step}: val_loss {loss:.4f} over {items} {self.item_name}{extra}")

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def finish(self, summary: Summary, step: int) -> None:
        """The final status (completed, or preempted by a signal) and the summary record."""
        if not self.is_main:
            return
        state = "preempted" if summary.preempted else "completed"
        write_status(self.run_dir, RunStatus(state, step, summary.preempted))
        if self.metrics is not None:
            totals = {key: getattr(summary, key) for key in SUMMARY_FIELDS}
            if summary.stopped:  # an own loop's early stop: completed, and why
                totals["stopped"] = summary.stopped
            self.metrics.write({"kind": "summary", "state": state, "step": step, **totals})
            self.metrics.close()
