"""``allreduce``'s first gradient bucket: bounded by ``strategy.bucket_mb`` like every other (one
all-reduce a step for a model under it, as the ``ddp`` strategy) against a 1 MiB first bucket
(what ``allreduce`` cut before 2026-12-05: two all-reduces a step for the README model).

A GPT of the README model's size (d_model 128, 4 layers, seq 64, global batch 32; 3.5 MB of
gradients) on 2 ranks (gloo on loopback, one thread each), trained by dtrain's loop. Both
variants run in the same two processes, alternating round by round (A B, B A, ...), a fresh
trainer each time; the 1 MiB variant is the strategy's module with its ``assign_buckets`` given
``first_cap_bytes`` for that round. Per round: rank 0's CPU per step (the process, all threads,
and its main thread), the median of its steps after the first 10; the figure is the median over
rounds of the difference within a round, so that two numbers are only compared moments apart.

    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_first_bucket.py --rounds 6
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conftest import tiny_raw
from tests.ranks import run_ranks

VARIANTS = ("bucket_mb", "1 MiB first")


def train_rounds(raws: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[float, ...]]]:
    """On each rank: every (variant, config) in turn; rank 0's CPU per step of each."""
    from tests.dist_helpers import make_trainer
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import dtrain.parallel.allreduce as allreduce
    from dtrain.parallel.grad_sync import MIB, assign_buckets

    marks: list[tuple[float, float]] = []  # (process, main thread) CPU at each step's end
    register_optimizer_step_post_hook(
        lambda *_: marks.append((time.process_time(), time.thread_time()))
    )
    out: dict[str, list[tuple[float, ...]]] = {name: [] for name in VARIANTS}
    try:
        for name, raw in raws:
            small_first = functools.partial(assign_buckets, first_cap_bytes=MIB)
            allreduce.assign_buckets = small_first if name == "1 MiB first" else assign_buckets
            trainer = make_trainer(raw)
            marks.clear()
            trainer.fit()
            gaps = [[b[i] - a[i] for a, b in itertools.pairwise(marks[10:])] for i in (0, 1)]
            buckets = len(trainer.strategy.buckets)  # type: ignore[attr-defined]
            out[name].append((*(statistics.median(g) * 1e3 for g in gaps), buckets))
    finally:
        allreduce.assign_buckets = assign_buckets
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=70)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dtrain-first-bucket-"))
    raws = []
    for r in range(args.rounds):
        for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            raw = tiny_raw(
                root / f"{r}-{name.replace(' ', '_')}",
                strategy={"name": "allreduce"},
                task={"d_model": 128, "n_layer": 4, "seq_len": 64, "samples": 2048},
                data={"global_batch_size": 32},
                train={"steps": args.steps, "log_every": 10},
                optim={"warmup_steps": 0},
                eval={"every": 0},
                checkpoint={"every": 0},
            )
            raws.append((name, raw))
    out = run_ranks(train_rounds, 2, raws, timeout=60 + 20 * len(raws))[0]
    for name, rows in out.items():
        process = ", ".join(f"{row[0]:.2f}" for row in rows)
        main_thread = ", ".join(f"{row[1]:.2f}" for row in rows)
        print(f"{name}: {int(rows[0][2])} bucket(s); CPU per step, rank 0 (ms): process {process};")
        print(f"    main thread {main_thread}")
    for i, what in enumerate(("process", "main thread")):
        diffs = [b[i] - a[i] for a, b in zip(out[VARIANTS[0]], out[VARIANTS[1]])]
        rounds = ", ".join(f"{d:+.2f}" for d in diffs)
        print(
            f"1 MiB first - bucket_mb, {what}: {statistics.median(diffs):+.2f} ms a step "
            f"(rounds {rounds})"
        )


if __name__ == "__main__":
    main()
