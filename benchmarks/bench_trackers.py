"""What an experiment tracker costs the step: the default job with W&B (offline) or MLflow (a
local SQLite store) as a sink, against the same job without it. Target: at most 1.01x (issue
43).

Measured side by side in one training run of the default job on 2 ranks (gloo on loopback, one
thread each), logging every step (``train.log_every = 1``) in every variant: the run is cut into
segments of ``--segment`` steps, and each round runs every variant for one segment, in
alternating order, switched at a step boundary (the ``train.step`` fail point) by putting the
tracker's sink into rank 0's sinks or taking it out:

- ``off``: ``metrics.jsonl`` and the progress line only;
- ``wandb``: W&B's sink too (``WANDB_MODE=offline``: its own process writes the run's file);
- ``mlflow``: MLflow's sink too (its own process makes an SQL transaction per batch of
  records; the step writes each record's line into its pipe).

The trackers' runs are opened before the first segment (W&B's process started, MLflow's store
made), as in a run they are while the first steps train. A tracker's own thread sends what it
queued once a second, so part of a segment's sending lands in the next one, whichever variant
that is: segments of several seconds keep that share small. Two steadier figures beside the
wall-time ratio: the job's CPU time per step (the tracker's thread included), and the work on
the step's path itself (the sink's ``write``: a record turned into numbers and queued, or
written to the tracker's pipe; its wall and CPU time) and on the tracker's thread (its CPU time
per record) or, for a tracker in a process of its own, that process's CPU time per record
(which the job's CPU time, the ranks', leaves out), measured on rank 0.

    .venv/bin/python benchmarks/bench_trackers.py               # prints the figures
    .venv/bin/python benchmarks/bench_trackers.py --write-docs  # also updates docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dtrain.config.load import build_config
from dtrain.fault.failpoints import failpoints
from dtrain.train.job import build_job_config, build_trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section
from bench_metrics import describe, ratios  # within each round, a variant over off

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import run_ranks

SECTION = "bench_trackers"


def measure(raw: dict[str, Any], opts: dict[str, Any]) -> dict[str, list[float]]:
    """On every rank: train through the planned segments; each variant's segment times."""
    import torch.distributed as dist

    from dtrain.metrics.trackers.process_sink import ProcessSink
    from dtrain.metrics.trackers.sink import TrackerSink

    kinds = (TrackerSink, ProcessSink)

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        Path(raw["run"]["dir"]).mkdir(parents=True, exist_ok=True)
        sys.stderr = open(Path(raw["run"]["dir"]) / "progress.log", "w")  # noqa: SIM115
    trainer = build_trainer(build_job_config(raw))
    variants: list[str] = opts["variants"]
    plan: dict[int, str] = {}  # first step of a segment -> its variant
    step = opts["warmup"] + 1
    for i in range(opts["rounds"]):
        for variant in variants if i % 2 == 0 else list(reversed(variants)):
            plan[step] = variant
            step += opts["segment"]
    end = step
    starts: dict[int, float] = {}
    cpu_starts: dict[int, float] = {}
    trackers: dict[str, TrackerSink | ProcessSink] = {}
    spent: dict[str, float] = {}  # the step's path in each tracker's write; its thread's CPU
    written: dict[str, int] = {}

    def add(key: str, value: float) -> None:
        spent[key] = spent.get(key, 0.0) + value

    def instrument(sink: TrackerSink | ProcessSink) -> None:
        name = sink.name
        write = sink.write

        def timed_write(record: dict[str, Any]) -> None:
            began, cpu = time.perf_counter(), time.thread_time()
            write(record)
            add(f"{name}: write", time.perf_counter() - began)
            add(f"{name}: write cpu", time.thread_time() - cpu)
            written[name] = written.get(name, 0) + 1

        sink.write = timed_write  # type: ignore[method-assign]
        if not isinstance(sink, TrackerSink):
            return  # its calls run in its own process, which counts its CPU time itself
        log = sink.tracker.log

        def timed_log(rows: Any) -> None:
            began = time.thread_time()  # this thread's CPU time: what it takes from the step
            log(rows)
            add(f"{name}: thread", time.thread_time() - began)

        sink.tracker.log = timed_log  # type: ignore[method-assign]

    def switch(name: str, **args: Any) -> None:
        if name != "train.step":
            return
        step = args["step"]
        if step in plan or step == end:
            starts[step] = time.perf_counter()
            cpu_starts[step] = time.process_time()
        sinks = trainer.run_log.metrics
        if sinks is None:  # not rank 0
            return
        if not trackers:  # the first step: the tracker sinks the run opened, put aside
            for sink in sinks.sinks:
                if isinstance(sink, kinds):
                    trackers[sink.name] = sink
                    instrument(sink)
        variant = plan.get(step)
        if variant is not None or step == end:
            kept = [s for s in sinks.sinks if not isinstance(s, kinds)]
            sinks.sinks = kept + ([trackers[variant]] if variant in trackers else [])

    with failpoints(switch):
        # The sinks' own warmup (W&B's process, MLflow's store) before the first segment.
        trainer.fit()
    for sink in trackers.values():  # taken out of the run's sinks, so not closed with them
        sink.close()
    times: dict[str, list[float]] = {v: [] for v in variants}
    times |= {f"{v}: cpu": [] for v in variants}
    bounds = [*sorted(plan), end]
    for first, after in itertools.pairwise(bounds):
        times[plan[first]].append(starts[after] - starts[first])
        times[f"{plan[first]}: cpu"].append(cpu_starts[after] - cpu_starts[first])
    for name in trackers:
        count = max(1, written.get(name, 0))
        sink = trackers[name]
        times[f"{name}: write per record"] = [spent.get(f"{name}: write", 0.0) / count]
        times[f"{name}: write cpu per record"] = [spent.get(f"{name}: write cpu", 0.0) / count]
        times[f"{name}: thread per record"] = [spent.get(f"{name}: thread", 0.0) / count]
        if isinstance(sink, ProcessSink):  # the process's own count of what it logged
            rows = max(1.0, sink.done.get("rows", 0.0))
            times[f"{name}: process per record"] = [sink.done.get("log_cpu_s", 0.0) / rows]
            times[f"{name}: process cpu"] = [sink.done.get("cpu_s", 0.0)]
        times[f"{name}: failed"] = [float(sink.failed.is_set())]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=16, help="segments of each variant")
    parser.add_argument("--segment", type=int, default=30, help="steps per segment")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the first segment")
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="ranks (2 fill this machine's 2 cores; 1 leaves the tracker's thread a core)",
    )
    args = parser.parse_args()
    names = [n for n in ("wandb", "mlflow") if importlib.util.find_spec(n) is not None]
    if not names:
        sys.exit("bench_trackers: neither wandb nor mlflow is installed: pip install -e '.[dev]'")
    variants = ["off", *names]
    steps = args.warmup + args.rounds * len(variants) * args.segment + 1
    with tempfile.TemporaryDirectory(prefix="bench-trackers-") as scratch:
        raw = build_config(
            {
                "run": {"dir": f"{scratch}/run"},
                "train": {"steps": steps, "log_every": 1},
                "eval": {"every": 0, "max_samples": 64},
                "checkpoint": {"every": 0},
                "dist": {"threads": 1},
                "task": {"generate_tokens": 0},
                "metrics": {"trackers": names, "tracking_uri": f"sqlite:///{scratch}/mlflow.db"},
            }
        ).to_dict()
        opts = {"rounds": args.rounds, "segment": args.segment, "warmup": args.warmup}
        env = {"WANDB_MODE": "offline", "WANDB_DIR": scratch, "WANDB_SILENT": "true"}
        os.environ.update(env)
        started = time.perf_counter()
        per_rank = run_ranks(
            measure, args.nproc, raw, opts | {"variants": variants}, timeout=7200, env=env
        )
        times = per_rank[0]
        for variant in variants:  # the job's CPU time: every rank's
            every = zip(*(rank[f"{variant}: cpu"] for rank in per_rank))
            times[f"{variant}: cpu"] = [sum(cpu) for cpu in every]
        wall = time.perf_counter() - started
    seg = args.segment
    off = statistics.median(times["off"]) / seg
    lines = [
        f"The default job on {args.nproc} rank(s), logging every step, {steps} steps in "
        f"{wall:.0f}s: {args.rounds} rounds of {seg}-step segments per variant, alternating.",
        f"  off:     {off * 1e3:.1f} ms/step (median)",
    ]
    for name in names:
        if times[f"{name}: failed"][0]:
            lines.append(f"  {name}: FAILED during the run (its warning is in progress.log)")
        step_ms = statistics.median(times[name]) / seg * 1e3
        lines.append(
            f"  {name + ':':8s} {step_ms:.1f} ms/step; ratio to off = "
            f"{describe(ratios(times, name))}; CPU time of the job "
            f"{describe(ratios(times, name, ': cpu'))}"
        )
        write_us = times[f"{name}: write per record"][0] * 1e6
        write_cpu_us = times[f"{name}: write cpu per record"][0] * 1e6
        thread_us = times[f"{name}: thread per record"][0] * 1e6
        own = thread_us + write_cpu_us  # the training process's CPU per record
        lines.append(
            f"           the step's path {write_us:.0f} us per record (the sink's write, "
            f"{write_cpu_us:.0f} us of CPU); the tracker's thread {thread_us:.0f} us of CPU "
            f"per record: {own:.0f} us of the training process's CPU per record "
            f"({100 * own / 1e6 / off:.2f}% of a step)"
        )
        if f"{name}: process per record" in times:
            process_us = times[f"{name}: process per record"][0] * 1e6
            lines.append(
                f"           its own process: {process_us:.0f} us of CPU per record, "
                f"{times[f'{name}: process cpu'][0]:.1f} s in all (start-up included), "
                "not in the job's CPU time"
            )
        target = statistics.median(ratios(times, name))
        lines.append(f"           target <= 1.01x: {'met' if target <= 1.01 else 'MISSED'}")
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        title = "Experiment trackers: W&B and MLflow sinks against none"
        setting = f"{args.nproc} rank(s), gloo on loopback, CPU, 1 thread per rank"
        print(f"wrote {write_report_section(SECTION, title, report, setting)}")


if __name__ == "__main__":
    main()
