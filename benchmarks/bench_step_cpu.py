"""Rank 0's CPU per step of two variants of one job, alternating in the same two processes, on
the README model's size (d_model 128, 4 layers, seq 64, global batch 32; 2 ranks, gloo on
loopback, one thread each):

- ``first-bucket``: ``allreduce`` with its first gradient bucket bounded by ``strategy.bucket_mb``
  like every other (one all-reduce a step for a model under it, as the ``ddp`` strategy) against
  a 1 MiB first bucket (what ``allreduce`` cut before 2026-12-05: two all-reduces a step here);
  the 1 MiB variant is the strategy's module with its ``assign_buckets`` replaced, for that
  round, by the old cut (``small_first`` below).
- ``own-loop``: an own loop (``dtrain.Run``, ``tests.own_loops.tiny_loop``) against dtrain's
  loop, under ``ddp``.

Rounds alternate the order (A B, B A, ...), each a fresh run. Per round: rank 0's CPU per step
(the process, all threads, and its main thread), the median of its steps after the first 10;
the figure is the median over rounds of the difference within a round. CPU per step moves by
1-3 ms from one launch to the next on a shared machine, which separate launches (``peers.py``)
cannot resolve below.

    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_step_cpu.py first-bucket --rounds 8
    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_step_cpu.py own-loop --rounds 8
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conftest import tiny_raw
from tests.ranks import run_ranks

# Each comparison: its strategy, then its two variants (the baseline first).
COMPARISONS = {
    "first-bucket": ("allreduce", ("bucket_mb", "1 MiB first")),
    "own-loop": ("ddp", ("dtrain's loop", "own loop")),
}


def train_rounds(raws: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[float, ...]]]:
    """On each rank: every (variant, config) in turn; rank 0's CPU per step of each."""
    import torch
    from tests.dist_helpers import make_trainer
    from tests.own_loops import tiny_loop
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import dtrain
    import dtrain.parallel.allreduce as allreduce
    from dtrain.parallel.grad_sync import MIB, assign_buckets
    from dtrain.train.job import build_job_config

    marks: list[tuple[float, float]] = []  # (process, main thread) CPU at each step's end
    register_optimizer_step_post_hook(
        lambda *_: marks.append((time.process_time(), time.thread_time()))
    )

    def small_first(params: list[torch.Tensor], cap: int) -> list[list[int]]:
        # The cut before the change: a first bucket of at most 1 MiB, then buckets of ``cap``
        # (one dtype here, so the first bucket is a run of leading parameters).
        first = assign_buckets(params, min(cap, MIB))[0]
        rest = assign_buckets(params[len(first) :], cap)
        return [first, *[[len(first) + i for i in bucket] for bucket in rest]]

    out: dict[str, list[tuple[float, ...]]] = {}
    try:
        for name, raw in raws:
            allreduce.assign_buckets = small_first if name == "1 MiB first" else assign_buckets
            marks.clear()
            if name == "own loop":
                dtrain.Run.join(build_job_config(raw)).train(tiny_loop)
            else:
                make_trainer(raw).fit()
            gaps = [[b[i] - a[i] for a, b in itertools.pairwise(marks[10:])] for i in (0, 1)]
            out.setdefault(name, []).append(tuple(statistics.median(g) * 1e3 for g in gaps))
    finally:
        allreduce.assign_buckets = assign_buckets
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("comparison", choices=sorted(COMPARISONS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=70)
    args = parser.parse_args()
    strategy, variants = COMPARISONS[args.comparison]
    root = Path(tempfile.mkdtemp(prefix="dtrain-step-cpu-"))
    raws = []
    for r in range(args.rounds):
        for i, name in enumerate(variants if r % 2 == 0 else variants[::-1]):
            raw = tiny_raw(
                root / f"{r}-{i}",
                strategy={"name": strategy},
                task={"d_model": 128, "n_layer": 4, "seq_len": 64, "samples": 2048},
                data={"global_batch_size": 32},
                train={"steps": args.steps, "log_every": 10},
                optim={"warmup_steps": 0},
                eval={"every": 0},
                checkpoint={"every": 0},
            )
            raws.append((name, raw))
    out = run_ranks(train_rounds, 2, raws, timeout=60 + 20 * len(raws))[0]
    for name in variants:
        process = ", ".join(f"{row[0]:.2f}" for row in out[name])
        main_thread = ", ".join(f"{row[1]:.2f}" for row in out[name])
        print(f"{name}: CPU per step, rank 0 (ms): process {process}; main thread {main_thread}")
    for i, what in enumerate(("process", "main thread")):
        diffs = [b[i] - a[i] for a, b in zip(out[variants[0]], out[variants[1]])]
        rounds = ", ".join(f"{d:+.2f}" for d in diffs)
        print(
            f"{variants[1]} - {variants[0]}, {what}: {statistics.median(diffs):+.2f} ms a step "
            f"(rounds {rounds})"
        )


if __name__ == "__main__":
    main()
