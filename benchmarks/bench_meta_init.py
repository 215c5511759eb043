"""Meta-device initialization under FSDP on 4 ranks: a model whose whole fp32 weights,
gradients and AdamW state do not fit one rank's memory limit trains when each rank makes only
its shard (task.meta_init), and fails when every rank first builds the whole model.

    sudo python benchmarks/bench_meta_init.py            # needs root: cgroup v1 memory limits
    python benchmarks/bench_meta_init.py --n-layer 8     # a smaller model

The default job's GPT, made large (12 blocks, d_model 768: 85 M parameters, 340 MB of fp32
weights, 1.36 GB with gradients and AdamW's two moments), fsdp on 4 ranks, 3 AdamW steps of
8 sequences of 128 bytes. First without a limit, meta-built and built whole: each rank's peak
resident memory above its size before the trainer was built (the kernel's VmHWM, reset just
before). Then each rank is put in a cgroup of its own whose memory limit lies between the two
peaks (baseline + their mean), and both builds run again: the meta-built one trains, the whole
one is killed by the kernel. Target: the meta-built peak <= 1.3 x the rank's share of weights,
gradients and optimizer state.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from dtrain.testing import RankFailed, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command_line, machine_line, update_section

CGROUP = Path("/sys/fs/cgroup/memory")


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def without_evaluation(trainer: Any) -> Any:
    """The trainer without its final evaluation over the whole validation set (hours for
    this model on this machine; the peak of interest is training's)."""
    trainer.evaluate = lambda max_samples=0: None
    return trainer


def train_rank(raw: dict[str, Any], limit_bytes: int) -> dict[str, float]:
    """In a rank: (under a memory limit of its own when given) build the trainer and train;
    the peak above the size before the trainer was built, and the rank's share."""
    import torch.distributed as dist

    from dtrain.job import build_job_config, build_trainer

    rank = dist.get_rank()
    group = CGROUP / f"dtrain-bench-meta-{os.environ['DTRAIN_BENCH_META_PID']}-{rank}"
    if limit_bytes:
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        swap = group / "memory.memsw.limit_in_bytes"  # no way around the limit through swap
        if swap.exists():
            swap.write_text(str(limit_bytes))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    # A tiny model trained first, in the same process, so that what any first run loads or
    # allocates once (lazy imports, the process group's buffers, the allocator's arenas) is
    # in the baseline, not in the peak.
    warm = {**raw, "run": {"dir": raw["run"]["dir"] + "-warm-up"}}
    warm["task"] = {**raw["task"], "n_layer": 1, "d_model": 96}
    without_evaluation(build_trainer(build_job_config(warm))).fit()
    cfg = build_job_config(raw)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kib("VmRSS")
    trainer = without_evaluation(build_trainer(cfg))
    trainer.fit()
    share = 4 * trainer.strategy.parameter_bytes()  # weights, gradients, AdamW's 2 moments
    return {"peak": (status_kib("VmHWM") - before) * 1024, "before": before * 1024, "share": share}


def config(run_dir: Path, meta: bool, n_layer: int, d_model: int) -> dict[str, Any]:
    return {
        "run": {"dir": str(run_dir)},
        "strategy": {"name": "fsdp"},
        "train": {"steps": 3, "log_every": 1},
        "data": {"global_batch_size": 8, "prefetch": 0},
        "eval": {"every": 0, "max_samples": 8, "batch_size": 2},
        "checkpoint": {"every": 0},
        "optim": {"warmup_steps": 0},
        "task": {
            "meta_init": meta,
            "n_layer": n_layer,
            "d_model": d_model,
            "n_head": 12,
            "generate_tokens": 0,
        },
    }


def cleanup() -> None:
    for group in CGROUP.glob(f"dtrain-bench-meta-{os.getpid()}-*"):
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# glibc's malloc raises its mmap threshold to the largest block freed (up to 32 MiB), after
# which a model's tensors come from the heap, whose freed pages it keeps: the resident peak
# then counts memory torch has given back. A fixed threshold returns large blocks to the
# kernel when freed, so the peak is what was live.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# The ranks name their cgroups after this process, which removes them (a rank's parent may be
# a fork server, not this process).
RANK_ENV = {"DTRAIN_BENCH_META_PID": str(os.getpid())}


def main() -> None:
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (CGROUP / "cgroup.procs").exists():
        raise SystemExit("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    scratch = Path(f"/tmp/dtrain-bench-meta-{os.getpid()}")
    mib = 2**20
    results: dict[str, Any] = {}
    try:
        for meta in (True, False):
            raw = config(scratch / f"free-{meta}", meta, args.n_layer, args.d_model)
            results[meta] = run_ranks(train_rank, 4, raw, 0, timeout=3600, env=RANK_ENV)
            peak = max(r["peak"] for r in results[meta])
            print(f"meta_init={meta}: peak {peak / mib:.0f} MiB above the start", flush=True)
        meta_peak = max(r["peak"] for r in results[True])
        whole_peak = max(r["peak"] for r in results[False])
        baseline = max(r["before"] for r in results[True] + results[False])
        limit = int(baseline + (meta_peak + whole_peak) / 2)
        print(f"limit per rank: {limit / mib:.0f} MiB", flush=True)
        outcome = {}
        for meta in (True, False):
            raw = config(scratch / f"limited-{meta}", meta, args.n_layer, args.d_model)
            try:
                run_ranks(train_rank, 4, raw, limit, timeout=3600, env=RANK_ENV)
                outcome[meta] = "trained"
            except RankFailed as exc:
                outcome[meta] = "failed: " + str(exc).splitlines()[0][:120]
            print(f"meta_init={meta} under the limit: {outcome[meta]}", flush=True)
            cleanup()
    finally:
        cleanup()
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    share = max(r["share"] for r in results[True])
    whole_model = 4 * share  # 4 ranks' shares: the whole model's weights, gradients, moments
    lines = [
        f"model: GPT {args.n_layer} x d{args.d_model}; weights + gradients + AdamW state "
        f"{whole_model / mib:,.0f} MiB in all, {share / mib:,.0f} MiB per rank's share",
        "| build | peak per rank above its start (MiB) | x its share | under a limit of "
        f"{limit / mib:,.0f} MiB per rank |",
        "|---|---:|---:|---|",
        f"| meta-built (task.meta_init) | {meta_peak / mib:,.0f} | **{meta_peak / share:.2f}x** "
        f"| {outcome[True]} |",
        f"| built whole on every rank | {whole_peak / mib:,.0f} | {whole_peak / share:.2f}x "
        f"| {outcome[False]} |",
    ]
    print("\n".join(lines))
    if args.write_docs:
        body = "\n".join(
            [
                "## Meta-device initialization under FSDP (`bench_meta_init.py`)",
                "",
                f"Command: `{command_line()}`  ",
                f"Machine: {machine_line()}  ",
                f"Date: {time.strftime('%Y-%m-%d')}; fsdp on 4 ranks, 3 AdamW steps; glibc's "
                "mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_); the limit "
                f"is each rank's start ({baseline / mib:,.0f} MiB, torch and the process "
                "group) plus the mean of the two peaks",
                "",
                *lines,
                "",
                "Target: the meta-built peak <= 1.3x the rank's share of weights, gradients and "
                "optimizer state (above the runtime's baseline).",
            ]
        )
        print(f"wrote {update_section('bench_meta_init', body)}")


if __name__ == "__main__":
    main()
