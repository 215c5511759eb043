"""``train.profile = "steps:A-B"``: a ``torch.profiler`` trace of steps A to B on every rank,
written to ``RUN_DIR/traces/rank<R>-steps<A>-<B>.json`` (:mod:`dtrain.metrics.traces`), a
Chrome trace that Perfetto (https://ui.perfetto.dev) and ``chrome://tracing`` open. For a run
folder in an object store each rank writes to its ``run.local_dir`` and uploads its traces at
each checkpoint and at the end (:meth:`StepProfiler.publish`).

The profiler exists only inside the window: built and started as step A begins (before its batch
is fetched, so the data wait shows), stopped, exported and dropped once step B has ended. Outside
it the loop pays one integer compare per step boundary; recording never changes the ops, so the
losses are an unprofiled run's bits. What a trace holds and costs: docs/observability.md,
"Profiler traces".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dtrain.checkpoint.publish import publish_files
from dtrain.config import Config
from dtrain.config.checks import parse_profile
from dtrain.fsutil import local_run_dir, scheme_of
from dtrain.metrics.traces import TRACES_DIR, trace_path


class StepProfiler:
    """The profiler of one window of steps; inert where ``train.profile = 'none'`` (its
    window then starts at step 0, which never begins: steps count from 1)."""

    def __init__(self, cfg: Config, rank: int, device: torch.device) -> None:
        self.first, self.last = parse_profile(cfg.train.profile) or (0, 0)
        self.run_dir = local_run_dir(cfg.run.dir, cfg.run.local_dir)  # this machine's
        self.rank, self.device = rank, device
        self.store_dir = cfg.run.dir if scheme_of(cfg.run.dir) else ""  # where it uploads
        self._published: set[str] = set()  # the names of this rank's traces uploaded
        self.shapes, self.stack = cfg.train.profile_shapes, cfg.train.profile_stack
        self._profiler: Any = None  # a torch.profiler.profile, only inside the window
        self._step_range: Any = None  # the open step's record_function

    def step_starting(self, step: int) -> None:
        """Step ``step`` (1-based) begins: the profiler starts at the window's first step, and
        each step inside it opens its range. A run resumed past step A records nothing."""
        if step == self.first:
            self._start()
        if self._profiler is not None:
            self._step_range = torch.profiler.record_function(f"dtrain step {step}")
            self._step_range.__enter__()

    def step_ended(self, step: int, stopping: bool) -> Path | None:
        """Step ``step`` has ended; at the window's last step, or where the ranks stop inside
        it (a preemption, an early stop), the trace is written and the profiler dropped.
        Returns the trace written, if one was."""
        if self._profiler is None:
            return None
        self._close_range()
        if step < self.last and not stopping:
            return None
        return self._write(step)

    def publish(self) -> None:
        """This rank's traces not yet in the store's run folder uploaded there (nothing for a
        local run folder, where they were written). Traces an earlier process of this rank left
        (a restart) go too."""
        folder = self.run_dir / TRACES_DIR
        if not self.store_dir or not folder.is_dir():
            return
        mine = sorted(folder.glob(f"rank{self.rank}-steps*.json"))
        new = [path for path in mine if path.name not in self._published]
        publish_files(self.store_dir, TRACES_DIR, new)
        self._published.update(path.name for path in new)

    def discard(self) -> None:
        """The loop left by an error inside the window: the profiler stopped, nothing written
        (a trace named for steps it did not finish would mislead)."""
        if self._profiler is not None:
            self._close_range()
            self._profiler.stop()
            self._profiler = None

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=self.shapes,
            with_stack=self.stack,
            profile_memory=True,
        )
        self._profiler.start()

    def _close_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _write(self, step: int) -> Path:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        path = trace_path(self.run_dir, self.rank, self.first, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Beside it, then renamed: `dtrain report` never lists half a trace.
        partial = path.with_name(f".tmp-{path.name}")
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, path)
        return path
