"""``allreduce`` against torch DDP, and bucketed against one all-reduce per tensor.

Two questions, each answered by a ratio measured side by side in one run, on 2 ranks (gloo on
loopback, one thread per rank):

1. Step time (forward + backward + gradient sync + SGD step) of ``allreduce`` over ``ddp`` on the
   same GPT, both built from the same config. Target: at most 1.05x.
2. Communication time of bucketed ``allreduce`` over one all-reduce per tensor, on an MLP with
   100+ small tensors: the reduction phase alone (backward runs without sync, untimed; then
   ``sync_gradients()`` reduces every gradient, timed). Target: at least 3x faster.

The strategies alternate block by block (A B B A ...) so that load from other users of the
machine hits both alike. A round runs each variant once (in alternating order); a variant's
time in a round is that of its slower rank, and a ratio is the median over rounds of the ratio
within a round, so that two figures are only ever compared with one taken moments apart.

    .venv/bin/python benchmarks/bench_allreduce.py              # prints the figures
    .venv/bin/python benchmarks/bench_allreduce.py --write-docs # also updates docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.config.load import build_config
from dtrain.dist.runtime import init_runtime
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel import build_strategy
from dtrain.parallel.allreduce import AllReduceStrategy
from dtrain.parallel.base import Strategy
from dtrain.task import Task
from dtrain.train.step import run_micro_batches

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import run_ranks

SECTION = "bench_allreduce"


def make_strategy(name: str, model: nn.Module, bucket_mb: float) -> Strategy:
    cfg = build_config({"strategy": {"name": name, "bucket_mb": bucket_mb}})
    strategy = build_strategy(cfg, init_runtime(cfg.dist))
    strategy.setup(Task(model=model, train_data=[], loss_fn=lambda out, y: out))
    return strategy


Run = tuple[Callable[[], None] | None, Callable[[], None]]  # (untimed preparation, timed part)


def timed(run: Run) -> float:
    prepare, fn = run
    if prepare is not None:
        prepare()
    dist.barrier()  # both ranks start together: a collective measures no wait for the other
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(runs: dict[str, Run], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Per-round times of each run; the order alternates A B C / C B A between rounds."""
    for _ in range(warmup):
        for run in runs.values():
            timed(run)
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            times[name].append(timed(runs[name]))
    return times


# -- 1. step time: allreduce vs ddp ----------------------------------------------------------


def gpt_step_times(opts: dict[str, Any]) -> dict[str, list[float]]:
    torch.manual_seed(0)
    config = GPTConfig(**opts["gpt"])
    steps: dict[str, Run] = {}
    batch = torch.randint(0, config.vocab_size, (opts["batch"], config.seq_len + 1))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    scale = torch.tensor(dist.get_world_size() / targets.numel())

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")

    for name in ("ddp", "allreduce"):
        torch.manual_seed(0)
        strategy = make_strategy(name, GPT(config), opts["bucket_mb"])
        strategy.before_first_step((inputs, targets), loss_fn)
        optimizer = torch.optim.SGD(strategy.parameters(), lr=1e-3)

        def step(
            strategy: Strategy = strategy, optimizer: torch.optim.Optimizer = optimizer
        ) -> None:
            run_micro_batches(strategy, [(inputs, targets)], loss_fn, scale)
            strategy.sync_gradients()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[name] = (None, step)
    # The same step with no gradient sync at all: what communication adds to each strategy.
    torch.manual_seed(0)
    local = GPT(config)
    local_optimizer = torch.optim.SGD(local.parameters(), lr=1e-3)

    def local_step() -> None:
        (loss_fn(local(inputs), targets).sum() * scale).backward()
        local_optimizer.step()
        local_optimizer.zero_grad(set_to_none=True)

    steps["no sync"] = (None, local_step)
    return alternate(steps, opts["rounds"], opts["warmup"])


# -- 2. communication: bucketed vs one all-reduce per tensor ---------------------------------


def mlp(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))
    )


def reduce_phase_times(opts: dict[str, Any]) -> dict[str, list[float]]:
    x = torch.randn(opts["batch"], opts["width"])
    runs: dict[str, Run] = {}
    buckets: list[float] = []
    for label, bucket_mb in (("bucketed", opts["bucket_mb"]), ("per_tensor", 1e-9)):
        strategy = make_strategy("allreduce", mlp(opts["layers"], opts["width"]), bucket_mb)
        assert isinstance(strategy, AllReduceStrategy)
        buckets.append(len(strategy.buckets))

        def local_backward(strategy: AllReduceStrategy = strategy) -> None:
            strategy.unwrapped.zero_grad(set_to_none=True)
            with strategy.no_backward_sync():  # gradients stay local ...
                strategy.unwrapped(x).square().mean().backward()

        # ... and the timed part reduces them all.
        runs[label] = (local_backward, strategy.sync_gradients)
    times = alternate(runs, opts["rounds"], opts["warmup"])
    times["buckets"] = buckets
    return times


# -- the run ---------------------------------------------------------------------------------


def slowest_rank(per_rank: list[dict[str, list[float]]], key: str) -> list[float]:
    return [max(values) for values in zip(*(rank[key] for rank in per_rank))]


def paired_ratios(per_rank: list[dict[str, list[float]]], top: str, bottom: str) -> list[float]:
    """``top / bottom`` within each round."""
    pairs = zip(slowest_rank(per_rank, top), slowest_rank(per_rank, bottom))
    return [a / b for a, b in pairs]


def paired_differences(per_rank: list[dict[str, list[float]]], top: str, bottom: str) -> float:
    """Median over rounds of ``top - bottom`` within each round."""
    pairs = zip(slowest_rank(per_rank, top), slowest_rank(per_rank, bottom))
    return statistics.median(a - b for a, b in pairs)


def describe(ratios: list[float], digits: int) -> str:
    """The median ratio, and the middle half of the rounds' ratios."""
    low, mid, high = statistics.quantiles(ratios, n=4)
    return f"{mid:.{digits}f}x (middle half of rounds {low:.{digits}f}-{high:.{digits}f})"


def median_of(per_rank: list[dict[str, list[float]]], key: str) -> float:
    return statistics.median(slowest_rank(per_rank, key))


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=30, help="GPT steps per variant")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="strategy.bucket_mb")
    args = parser.parse_args()
    lines: list[str] = []

    gpt = {"vocab_size": 256, "seq_len": 128, "n_layer": 4, "n_head": 4, "d_model": 256}
    step_opts = {"gpt": gpt, "batch": 8, "bucket_mb": args.bucket_mb}
    step_opts |= {"rounds": args.rounds, "warmup": 2}
    per_rank = run_ranks(gpt_step_times, 2, step_opts, timeout=1800)
    ddp, ours = median_of(per_rank, "ddp"), median_of(per_rank, "allreduce")
    ratios = paired_ratios(per_rank, "allreduce", "ddp")
    ddp_sync = paired_differences(per_rank, "ddp", "no sync")
    our_sync = paired_differences(per_rank, "allreduce", "no sync")
    params = sum(p.numel() for p in GPT(GPTConfig(**gpt)).parameters())
    lines += [
        f"1. step time, a GPT of 4 layers, d_model 256 ({params / 1e6:.2f} M parameters, "
        f"per-rank batch "
        f"{step_opts['batch']} x {gpt['seq_len']} tokens, bucket_mb {step_opts['bucket_mb']:g}), "
        f"median of {args.rounds} rounds:",
        f"   ddp {ms(ddp)}   allreduce {ms(ours)}",
        f"   ratio allreduce/ddp = {describe(ratios, 3)}; target <= 1.05x",
        f"   (sync's share, against the same step without any sync in the same round: "
        f"{ms(ddp_sync)} in ddp, {ms(our_sync)} in allreduce)",
    ]

    mlp_opts = {"layers": 64, "width": 64, "batch": 32, "bucket_mb": 25.0}
    mlp_opts |= {"rounds": 4 * args.rounds, "warmup": 3}
    per_rank = run_ranks(reduce_phase_times, 2, mlp_opts, timeout=1800)
    bucketed, per_tensor = median_of(per_rank, "bucketed"), median_of(per_rank, "per_tensor")
    speedups = paired_ratios(per_rank, "per_tensor", "bucketed")
    n_bucketed, n_tensor = per_rank[0]["buckets"]
    lines += [
        f"2. communication, MLP of {mlp_opts['layers']} Linear({mlp_opts['width']}, "
        f"{mlp_opts['width']}) = {int(n_tensor)} tensors, reduction phase alone:",
        f"   one all-reduce per tensor ({int(n_tensor)} collectives) {ms(per_tensor)}   "
        f"bucketed ({int(n_bucketed)} bucket(s)) {ms(bucketed)}",
        f"   bucketed is {describe(speedups, 1)} faster; target >= 3x",
    ]
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        title = "allreduce vs ddp; bucketed vs per-tensor"
        setting = "2 ranks, gloo on loopback, CPU, 1 thread per rank"
        print(f"wrote {write_report_section(SECTION, title, report, setting)}")


if __name__ == "__main__":
    main()
