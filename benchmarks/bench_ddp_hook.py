"""What a Python comm hook costs DDP: its built-in C++ all-reduce against our counting hook.

``ddp`` counts the bytes of its gradient all-reduces (``comm_bytes_per_step``) and the time it
waits on them through a Python communication hook (``dtrain.comm.hooks.MeanHook``: divide,
all-reduce, count), registered even without compression. Torch's DDP otherwise all-reduces in
C++. The question: does the Python hook slow a step down? One ratio, measured side by side in
one run on 2 ranks (gloo on loopback, one thread per rank): step time (forward + backward +
gradient sync + SGD step) of DDP with the hook over DDP without it, on the same GPT, at the
default bucket size and at a small one (many buckets: many hook calls per step).

Variants alternate round by round (A B / B A ...); a variant's time in a round is that of its
slower rank; a ratio is the median over rounds of the ratio within a round.

    .venv/bin/python benchmarks/bench_ddp_hook.py              # prints the figures
    .venv/bin/python benchmarks/bench_ddp_hook.py --write-docs # also updates docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.comm.accounting import CommCounter
from dtrain.comm.hooks import MeanHook, run_comm_hook
from dtrain.models.gpt import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import run_ranks

from bench_allreduce import (
    Run,
    alternate,
    describe,
    median_of,
    ms,
    paired_differences,
    paired_ratios,
)

SECTION = "bench_ddp_hook"


def build(opts: dict[str, Any]) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The model and a loss of it on a fixed batch (the same on each call)."""
    torch.manual_seed(0)
    if "gpt" in opts:
        config = GPTConfig(**opts["gpt"])
        batch = torch.randint(0, config.vocab_size, (opts["batch"], config.seq_len + 1))
        inputs, targets = batch[:, :-1], batch[:, 1:]

        def gpt_loss(model: nn.Module) -> torch.Tensor:
            logits = model(inputs)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

        return GPT(config), gpt_loss
    width = opts["width"]
    x = torch.randn(opts["batch"], width)
    layers = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(opts["layers"])]
    return nn.Sequential(*layers), lambda model: model(x).square().mean()


def step_times(opts: dict[str, Any]) -> dict[str, Any]:
    runs: dict[str, Run] = {}
    counter = CommCounter()
    for label in ("builtin", "hook"):
        module, loss_of = build(opts)
        model = DistributedDataParallel(module, bucket_cap_mb=opts["bucket_mb"])
        if label == "hook":
            model.register_comm_hook(MeanHook(counter, None, torch.device("cpu")), run_comm_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(
            model: DistributedDataParallel = model,
            optimizer: torch.optim.Optimizer = optimizer,
            loss_of: Callable[[nn.Module], torch.Tensor] = loss_of,
        ) -> None:
            loss_of(model).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        runs[label] = (None, step)
    step()  # the hook's first step: one bucket; DDP rebuilds its buckets before the second
    before = counter.collectives
    step()
    buckets = counter.collectives - before  # hook calls in a step: one per bucket
    times: dict[str, Any] = dict(alternate(runs, opts["rounds"], opts["warmup"]))
    times["buckets"] = [buckets]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=30, help="steps per variant")
    args = parser.parse_args()
    gpt = {"vocab_size": 256, "seq_len": 128, "n_layer": 4, "n_head": 4, "d_model": 256}
    params = sum(p.numel() for p in GPT(GPTConfig(**gpt)).parameters())
    cases = [
        (
            f"GPT (4 layers, d_model 256, {params / 1e6:.2f} M parameters, batch 8 x 128), "
            "bucket_mb 25",
            {"gpt": gpt, "batch": 8, "bucket_mb": 25.0},
        ),
        ("the same GPT, bucket_mb 0.25", {"gpt": gpt, "batch": 8, "bucket_mb": 0.25}),
        # The worst case: many buckets, little compute and few bytes per bucket, so that the
        # hook's per-bucket cost is all there is to see.
        (
            "MLP of 64 Linear(64, 64), batch 32, bucket_mb 0.01",
            {"layers": 64, "width": 64, "batch": 32, "bucket_mb": 0.01},
        ),
    ]
    lines = [
        "DDP step time with our Python hook (MeanHook) / with DDP's built-in all-reduce, "
        f"median of {args.rounds} rounds:"
    ]
    for title, opts in cases:
        opts |= {"rounds": args.rounds, "warmup": 2}
        per_rank = run_ranks(step_times, 2, opts, timeout=1800)
        ratios = paired_ratios(per_rank, "hook", "builtin")
        buckets = int(per_rank[0]["buckets"][0])
        builtin, hook = median_of(per_rank, "builtin"), median_of(per_rank, "hook")
        # The median over rounds of the difference within a round, per hook call.
        per_bucket_us = paired_differences(per_rank, "hook", "builtin") / buckets * 1e6
        lines += [
            f"  {title} ({buckets} buckets):",
            f"    built-in {ms(builtin)}, hook {ms(hook)}; ratio hook/built-in = "
            f"{describe(ratios, 3)}; {per_bucket_us:+.0f} us per bucket (paired)",
        ]
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        title = "ddp: a Python comm hook against DDP's built-in all-reduce"
        setting = "2 ranks, gloo on loopback, CPU, 1 thread per rank"
        print(f"wrote {write_report_section(SECTION, title, report, setting)}")


if __name__ == "__main__":
    main()
