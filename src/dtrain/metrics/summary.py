"""What a run reports at its end and between metrics lines: the run's summary, the printed
closing lines, and the loss window behind each metrics line."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dtrain.metrics.sinks import format_duration, format_rate
from dtrain.parallel.base import Strategy


@dataclass
class Summary:
    steps: int = 0
    start_step: int = 0
    wall_s: float = 0.0
    train_loss: float = float("nan")
    val_loss: float | None = None
    items: int = 0  # trained this run (the rate divides them by this run's wall_s)
    start_items: int = 0  # the run's count when this run started (a resume's, else 0)
    skipped_steps: int = 0
    rollbacks: int = 0
    preempted: str = ""  # the signal's name when the run stopped early to be resumed
    stopped: str = ""  # why a loop of the user's own stopped before train.steps (run.stop())
    checkpoint: str = ""
    generated: str = ""
    comm_bytes: int = 0  # this rank's, over the run (dtrain.comm.accounting)
    comm_wait_s: float = 0.0
    val_metrics: dict[str, float] = field(default_factory=dict)  # Task.metrics, at the end
    # The run folder held a run that had reached train.steps: nothing was trained.
    finished_before: bool = False


class LossWindow:
    """Loss and items since the last metrics line; summed over ranks only when logged.

    The sum starts right after the logged step's backward (:meth:`start_sum`), when the
    gradient all-reduce has just brought the ranks together, and is waited for at the step's
    end (:meth:`flush`): it overlaps the optimizer step instead of making every logged step
    wait for the slowest rank a second time."""

    FOLD = 64  # steps whose losses are kept before they are added up

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Each step's summed loss as the step left it, added up in float64 once per window (at
        # start_sum) or per FOLD steps, whichever comes first: no small ops on every step, and
        # folding bounds what a long window holds.
        self._losses: list[torch.Tensor] = []
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.items = 0
        self.steps = 0
        self.start = time.perf_counter()
        self._wait: Callable[[], None] | None = None  # the sum in flight

    def add(self, loss_sum: torch.Tensor, items: int) -> None:
        assert self._wait is None, "LossWindow.add while its sum is in flight"
        self._losses.append(loss_sum)
        self.items += items
        self.steps += 1
        if len(self._losses) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        if self._losses:
            self.loss = self.loss + torch.stack(self._losses).to(torch.float64).sum()
            self._losses.clear()

    def start_sum(self, strategy: Strategy) -> None:
        """Start summing the window's loss over the ranks (collective)."""
        self._fold()
        self._wait = strategy.start_loss_all_reduce(self.loss)

    def flush(self) -> tuple[float, float, int, float]:
        """The window's (mean loss over all ranks, items per second, steps, seconds), once
        :meth:`start_sum` has been called. A new window begins."""
        assert self._wait is not None, "LossWindow.flush before start_sum"
        self._wait()
        self._wait = None
        elapsed = time.perf_counter() - self.start
        loss = float(self.loss) / max(1, self.items)
        rate = self.items / elapsed if elapsed > 0 else 0.0
        out = (loss, rate, self.steps, elapsed)
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.items, self.steps = 0, 0
        self.start = time.perf_counter()
        return out


def print_summary(summary: Summary, item_name: str, world_size: int) -> None:
    if summary.finished_before:
        text = (
            f"\nalready finished: step {summary.steps} of {summary.steps}, nothing trained; "
            f"checkpoint {summary.checkpoint}"
        )
        print(text + (f"\n\n{summary.generated}" if summary.generated else ""), flush=True)
        return
    rate = summary.items / summary.wall_s if summary.wall_s > 0 else 0.0
    val = f"{summary.val_loss:.4f}" if summary.val_loss is not None else "n/a"
    for name, value in summary.val_metrics.items():
        val += f"   val {name} {value:.4f}"
    if summary.preempted:
        # Facts only: how to resume is the launcher's line, printed once (`dtrain train`).
        head = f"stopped by {summary.preempted} and saved at step {summary.steps}"
    else:
        head = f"done: {summary.steps} steps"
        if summary.stopped:
            head += f", stopped early ({summary.stopped})"
    # Under a minute in tenths: a short run said "in 0m00s" (whole seconds, cut down).
    took = format_duration(summary.wall_s) if summary.wall_s >= 60 else f"{summary.wall_s:.1f}s"
    lines = [
        "",
        f"{head} ({summary.steps - summary.start_step} this run) on {world_size} rank(s) in {took}",
        f"  train loss {summary.train_loss:.4f}   val loss {val}   "
        f"{format_rate(rate)} {item_name}/s overall",
    ]
    if summary.skipped_steps:
        lines.append(
            f"  skipped steps (non-finite loss or gradient): {summary.skipped_steps}, "
            f"rollbacks: {summary.rollbacks}"
        )
    if summary.comm_bytes:
        share = summary.comm_wait_s / summary.wall_s if summary.wall_s > 0 else 0.0
        lines.append(
            f"  communication: {summary.comm_bytes / 1e9:.3f} GB sent by rank 0, "
            f"{share:.0%} of the wall time waiting on it"
        )
    lines.append(f"  checkpoint {summary.checkpoint}")
    if summary.generated:
        lines += ["", summary.generated]
    print("\n".join(lines), flush=True)
