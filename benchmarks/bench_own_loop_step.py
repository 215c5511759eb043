"""An own loop's CPU per step (``dtrain.Run``, ``tests.own_loops.tiny_loop``) against dtrain's
loop on the same job: the README model's size (d_model 128, 4 layers, seq 64, global batch 32),
ddp, 2 ranks (gloo on loopback, one thread each).

Both loops run in the same two processes, alternating round by round (A B, B A, ...), each a
fresh run. Per round: rank 0's CPU per step (the process, all threads, and its main thread),
the median of its steps after the first 10; the figure is the median over rounds of the
difference within a round. CPU per step moves by 1-3 ms from one launch to the next on a
shared machine, which a comparison of separate launches (``peers.py``) cannot resolve below.

    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_own_loop_step.py --rounds 8
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

LOOPS = ("dtrain's loop", "own loop")


def train_rounds(raws: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[float, ...]]]:
    """On each rank: every (loop, config) in turn; rank 0's CPU per step of each."""
    from tests.dist_helpers import make_trainer
    from tests.own_loops import tiny_loop
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import dtrain
    from dtrain.train.job import build_job_config

    marks: list[tuple[float, float]] = []  # (process, main thread) CPU at each step's end
    register_optimizer_step_post_hook(
        lambda *_: marks.append((time.process_time(), time.thread_time()))
    )
    out: dict[str, list[tuple[float, ...]]] = {name: [] for name in LOOPS}
    for name, raw in raws:
        marks.clear()
        if name == "own loop":
            dtrain.Run.join(build_job_config(raw)).train(tiny_loop)
        else:
            make_trainer(raw).fit()
        gaps = [[b[i] - a[i] for a, b in itertools.pairwise(marks[10:])] for i in (0, 1)]
        out[name].append(tuple(statistics.median(g) * 1e3 for g in gaps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dtrain-own-loop-step-"))
    raws = []
    for r in range(args.rounds):
        for i, name in enumerate(LOOPS if r % 2 == 0 else LOOPS[::-1]):
            raw = tiny_raw(
                root / f"{r}-{i}",
                strategy={"name": "ddp"},
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
        print(f"{name}: CPU per step, rank 0 (ms): process {process}")
    for i, what in enumerate(("process", "main thread")):
        diffs = [b[i] - a[i] for a, b in zip(out[LOOPS[0]], out[LOOPS[1]])]
        rounds = ", ".join(f"{d:+.2f}" for d in diffs)
        print(
            f"own loop - dtrain's loop, {what}: {statistics.median(diffs):+.2f} ms a step "
            f"(rounds {rounds})"
        )


if __name__ == "__main__":
    main()
