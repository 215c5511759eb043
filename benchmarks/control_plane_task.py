"""The task of ``benchmarks/control_plane.py``, with the instruments it reads.

The model is tiny and each forward sleeps ``sleep_ms``: a step's wall time stays about the same
at 2 and at 32 ranks on a 2-core machine (sleeping ranks leave the cores to the others), and
what the control plane costs is not drowned in compute. Built in every worker, the task also
wraps the control plane's entry points there -- a benchmark's instruments, not the product's --
and writes, when the worker exits, ``RUN_DIR/bench/rankN.json``:

- ``store_ops``: calls this rank made to the job's key-value store (the watchdog's client: beats,
  reads of rank 0's beat, failure posts), by kind;
- ``watchdog_cpu_s``: CPU time of the watchdog's thread (it beats, stamps and measures);
- ``main_cpu_s``: CPU time of the training thread inside the control plane's calls: liveness
  phases and progress marks, the load balancer's per-step hooks (timing, and once a window the
  gather, straggler analysis and ``ranks`` record), the metrics sinks and the loss window;
- ``steps`` and ``train_s``: steps trained in this process, and the wall time between its first
  and last step;
- ``commit_s``: each checkpoint's agreement -- from the ranks' gather of their outcomes to
  rank 0's word on the commit (the marker written in between on rank 0).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import dtrain


@dataclass
class ControlPlaneOptions:
    samples: int = 4096
    width: int = 32
    sleep_ms: float = 100.0
    warmup_steps: int = 20  # steps before the counters the report reads start


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, samples: int, width: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, width, generator=generator)
        self.y = torch.randint(0, 4, (samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class SleepyMLP(nn.Module):
    def __init__(self, width: int, sleep_ms: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
        self.sleep_s = sleep_ms / 1000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.sleep_s:
            time.sleep(self.sleep_s)
        return self.net(x)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


# -- the instruments ------------------------------------------------------------------------

# A fixed piece of Python work, timed beside the control plane on the thread that runs it:
# CPU time per call grows when many processes share few cores (caches, frequency), for the
# control plane and this alike, so the report counts the control plane in units of it.
_REFERENCE_RECORD = {"rank": 3, "host": "host-a", "pid": 4121, "step": 120, "phase": "data"}
_REFERENCE_TIMES = [0.1 * i for i in range(16)]


def _reference_work() -> float:
    """CPU seconds this thread takes for the fixed work (JSON round trips, a small median)."""
    started = time.thread_time()
    for _ in range(50):
        json.loads(json.dumps(_REFERENCE_RECORD))
        sorted(_REFERENCE_TIMES)[8]
    return time.thread_time() - started


_STATS: dict[str, Any] = {
    "store_ops": Counter(),
    "main_cpu_s": 0.0,
    "main_cpu_by": Counter(),
    "inner_cpu_by": Counter(),
    "watchdog_cpu_s": None,
    "steps": 0,
    "first_step": None,
    "last_step": None,
    "commit_s": [],
    "counts": Counter(),  # the watchdog's beats, wakes (stamps), syncs; set_phase calls
    "main_ref_s": [],  # the reference work's CPU time, on the training thread
    "watchdog_ref_s": [],  # ... and on the watchdog's thread (not counted in its CPU)
}
_COMMIT_STARTED: dict[int, float] = {}
# The counters as they stood after the first ``warmup_steps`` steps (the first window's
# collective set-up, the first checkpoint's, lazy imports): the report counts from there.
_WARMUP: dict[str, Any] = {"steps": 0, "at": None}
_WATCHDOG: dict[str, Any] = {"thread": None}


def _snapshot() -> dict[str, Any]:
    thread = _WATCHDOG["thread"]
    return {
        "steps": _STATS["steps"],
        "time": time.perf_counter(),
        "store_ops": sum(_STATS["store_ops"].values()),
        "main_cpu_s": _STATS["main_cpu_s"],
        "main_cpu_by": dict(_STATS["main_cpu_by"]),
        "inner_cpu_by": dict(_STATS["inner_cpu_by"]),
        "watchdog_cpu_s": _thread_cpu_s(thread.native_id) if thread is not None else None,
        "watchdog_ref_cpu_s": sum(_STATS["watchdog_ref_s"]),
        "counts": dict(_STATS["counts"]),
    }


def _thread_cpu_s(native_id: int | None) -> float | None:
    """CPU seconds of one of this process's threads, from another thread: its clock id."""
    if native_id is None:
        return None
    try:
        clock = time.pthread_getcpuclockid(_thread_ident(native_id))
    except (OSError, LookupError):
        return None
    return time.clock_gettime(clock)


def _thread_ident(native_id: int) -> int:
    for thread in threading.enumerate():
        if thread.native_id == native_id and thread.ident is not None:
            return thread.ident
    raise LookupError(native_id)


_DEPTH = threading.local()


def _cpu_timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn``, its CPU time on the calling thread added to ``main_cpu_s`` and to its own
    entry of ``main_cpu_by`` (the training thread calls every function wrapped so; a call
    inside another wrapped one counts once, in the outer one)."""

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if getattr(_DEPTH, "n", 0):
            return fn(*args, **kwargs)
        _DEPTH.n = 1
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - started
            _STATS["main_cpu_s"] += spent
            _STATS["main_cpu_by"][name] += spent
            _DEPTH.n = 0

    return timed


def _instrument() -> None:
    from dtrain.balance.balancer import LoadBalancer
    from dtrain.checkpoint.write import Checkpointer
    from dtrain.dist.store_link import StoreLink
    from dtrain.fault.watchdog import Watchdog
    from dtrain.metrics.sinks import Sinks
    from dtrain.metrics.summary import LossWindow

    call = StoreLink.call

    def counted_call(self: StoreLink, op: Any, what: str, seconds: float | None = None) -> Any:
        kind = what.split(" ")[0] if what.startswith("reading") else what
        _STATS["store_ops"][kind] += 1
        return call(self, op, what, seconds)

    StoreLink.call = counted_call  # type: ignore[method-assign]

    for cls, names in (
        (Watchdog, ("set_phase", "tick")),
        (LoadBalancer, ("step_started", "data_ready", "backward_done", "step_finished")),
        (Sinks, ("write",)),
        (LossWindow, ("add", "start_sum", "flush")),
    ):
        for name in names:
            setattr(cls, name, _cpu_timed(getattr(cls, name), f"{cls.__name__}.{name}"))

    # Inside the balancer's hooks, once a window: the gather (started, then taken) and what
    # every rank does with the gathered rows -- the parts whose size is the world's.
    from dtrain.balance import balancer

    def inner(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                _STATS["inner_cpu_by"][name] += time.thread_time() - started

        return timed

    start_gather = balancer.start_gather_windows

    def gathering(*args: Any, **kwargs: Any) -> Any:
        return inner(inner(start_gather, "gather_start")(*args, **kwargs), "gather_result")

    balancer.start_gather_windows = gathering
    LoadBalancer._on_window = inner(LoadBalancer._on_window, "on_window")  # type: ignore[method-assign]

    step_finished = LoadBalancer.step_finished

    def stepped(self: LoadBalancer, step: int) -> Any:
        records = step_finished(self, step)
        now = time.perf_counter()
        _STATS["steps"] += 1
        _STATS["first_step"] = _STATS["first_step"] or now
        _STATS["last_step"] = now
        if _STATS["steps"] == _WARMUP["steps"]:
            _WARMUP["at"] = _snapshot()
        elif _STATS["steps"] > _WARMUP["steps"] and _STATS["steps"] % 5 == 0:
            _STATS["main_ref_s"].append(_reference_work())
        return records

    LoadBalancer.step_finished = stepped  # type: ignore[method-assign]

    measure = Watchdog._measure

    def measuring(self: Watchdog, now: float) -> None:
        measure(self, now)
        if _WARMUP["at"] is not None and self._thread is threading.current_thread():
            _STATS["watchdog_ref_s"].append(_reference_work())

    Watchdog._measure = measuring  # type: ignore[method-assign]

    from dtrain.fault.liveness import LivenessFile

    def counted(cls: Any, name: str, what: str) -> None:
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def count(*args: Any, **kwargs: Any) -> Any:
            _STATS["counts"][what] += 1
            return fn(*args, **kwargs)

        setattr(cls, name, count)

    counted(Watchdog, "_beat", "beats")
    counted(LivenessFile, "stamp", "stamps")
    counted(LivenessFile, "sync", "syncs")
    counted(Watchdog, "set_phase", "set_phase")

    run = Watchdog._run

    def running(self: Watchdog) -> None:
        _WATCHDOG["thread"] = threading.current_thread()
        try:
            run(self)
        finally:  # the thread's own CPU clock, read on the thread as it ends
            _STATS["watchdog_cpu_s"] = time.thread_time()

    Watchdog._run = running  # type: ignore[method-assign]

    # The checkpoint's agreement: gather of the outcomes ... rank 0's word on the commit.
    gather, agree = (
        getattr(Checkpointer, "_gather", None),
        getattr(Checkpointer, "_agree_on_commit", None),
    )
    if gather is not None and agree is not None:

        def gathering(self: Checkpointer, *args: Any) -> Any:
            _COMMIT_STARTED[id(self)] = time.perf_counter()
            return gather(self, *args)

        def agreeing(self: Checkpointer, *args: Any) -> Any:
            word = agree(self, *args)
            started = _COMMIT_STARTED.pop(id(self), None)
            if started is not None:
                _STATS["commit_s"].append(time.perf_counter() - started)
            return word

        Checkpointer._gather = gathering  # type: ignore[method-assign]
        Checkpointer._agree_on_commit = agreeing  # type: ignore[method-assign]


def _write_stats(run_dir: str) -> None:
    first, last = _STATS["first_step"], _STATS["last_step"]
    end = {**_snapshot(), "watchdog_cpu_s": _STATS["watchdog_cpu_s"]}
    out = {
        **{k: v for k, v in _STATS.items() if k not in ("first_step", "last_step")},
        "warm": _WARMUP["at"],
        "end": end,
        "store_ops": dict(_STATS["store_ops"]),
        "main_cpu_by": dict(_STATS["main_cpu_by"]),
        "inner_cpu_by": dict(_STATS["inner_cpu_by"]),
        "train_s": (last - first) if first is not None and last is not None else 0.0,
        "rank": int(os.environ.get("RANK", "0")),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    folder = Path(run_dir) / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{out['rank']}-attempt{out['attempt']}.json").write_text(json.dumps(out))


@dtrain.task_config(ControlPlaneOptions)
def build(cfg: dtrain.Config) -> dtrain.Task:
    opts: ControlPlaneOptions = cfg.task
    _WARMUP["steps"] = opts.warmup_steps
    _instrument()
    atexit.register(_write_stats, cfg.run.dir)
    return dtrain.Task(
        model=SleepyMLP(opts.width, opts.sleep_ms),
        train_data=Tokens(opts.samples, opts.width),
        loss_fn=_loss,
        items_per_sample=1,
    )
