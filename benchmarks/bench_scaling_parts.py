"""Where a 2-worker step's extra time goes: weak scaling of the default GPT, part by part.

``peers.py`` measures weak scaling whole (per-worker throughput at 2 workers over 1). This
script takes the step apart, on the same model and per-worker batch, with seven variants
timed side by side, one step each per round, in alternating order:

- ``1 worker``: the plain model, on rank 0, while rank 1 waits idle (one worker alone on
  the machine: the baseline of weak scaling);
- ``2 workers, no DDP``: both ranks step the plain model at once, each on its own (two
  workers sharing the machine's cores, caches and memory);
- ``+ DDP, no sync``: the same wrapped in DDP with a comm hook that sends nothing (DDP's
  bookkeeping: its hooks, its buckets);
- ``+ meeting``: the hook only meets the other rank (a 1-element all-reduce, awaited), then
  keeps the local gradient (the wait for the later rank, and a collective's latency);
- ``+ all-reduce, DDP built-in``: the gradient averaged by DDP's own C++ all-reduce;
- ``+ all-reduce, dtrain ddp's hook``: the same through dtrain's counting hook
  (``dtrain.comm.hooks.MeanHook``) and gloo, as ``dtrain train`` runs it with
  ``comm.transport = "backend"``;
- ``+ all-reduce, hook, shared memory``: the same hook summing through a shared-memory segment
  (``dtrain.ext.shm``), as ``dtrain train`` runs it by default on one machine.

Every variant is forward + backward + AdamW step; a round starts each variant on both ranks at
once (a barrier, untimed) and takes the slower rank's time; efficiency = the 1-worker step /
the variant's step within a round, median over rounds.

    .venv/bin/python benchmarks/bench_scaling_parts.py              # prints the figures
    .venv/bin/python benchmarks/bench_scaling_parts.py --write-docs # also docs/benchmarks.md
"""

# No "from __future__ import annotations": DDP's register_comm_hook checks the hooks'
# annotations as objects (dtrain.comm.hooks says more).
import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

from dtrain.comm.accounting import CommCounter
from dtrain.comm.hooks import MeanHook, run_comm_hook
from dtrain.ext.shm import SharedMemoryAllReduce
from dtrain.models.gpt import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import run_ranks

from bench_allreduce import Run, alternate, ms, paired_differences, paired_ratios, slowest_rank

SECTION = "bench_scaling_parts"
# The default job's GPT (dtrain.tasks.gpt) and peers.py's weak-scaling batch per worker.
GPT_OPTS = {"vocab_size": 256, "seq_len": 128, "n_layer": 3, "n_head": 4, "d_model": 192}
SOLO, TWO, NO_SYNC, MEET, BUILTIN, HOOK, SHARED = (
    "1 worker",
    "2 workers, no DDP",
    "+ DDP, no sync",
    "+ meeting",
    "+ all-reduce, DDP built-in",
    "+ all-reduce, dtrain ddp's hook",
    "+ all-reduce, hook, shared memory",
)
VARIANTS = [SOLO, TWO, NO_SYNC, MEET, BUILTIN, HOOK, SHARED]
# What each variant adds to: the column "added" (the all-reduces to the meeting).
BASE = {TWO: SOLO, NO_SYNC: TWO, MEET: NO_SYNC, BUILTIN: MEET, HOOK: MEET, SHARED: MEET}


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


def keep_local(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """No communication: each rank keeps its own gradient."""
    return _done(bucket.buffer())


def meet_only(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Meet the other rank (a 1-element all-reduce, awaited); keep the local gradient."""
    dist.all_reduce(torch.zeros(1))
    return _done(bucket.buffer())


def step_times(opts: dict[str, Any]) -> dict[str, list[float]]:
    config = GPTConfig(**opts["gpt"])
    generator = torch.Generator().manual_seed(dist.get_rank())
    batch = torch.randint(
        0, config.vocab_size, (opts["batch"], config.seq_len + 1), generator=generator
    )
    inputs, targets = batch[:, :-1], batch[:, 1:]
    runs: dict[str, Run] = {}
    for label in VARIANTS:
        torch.manual_seed(0)
        module = GPT(config)
        model: nn.Module = module
        if label not in (SOLO, TWO):
            model = DistributedDataParallel(
                module, bucket_cap_mb=25.0, gradient_as_bucket_view=True
            )
            if label == NO_SYNC:
                model.register_comm_hook(None, keep_local)
            elif label == MEET:
                model.register_comm_hook(None, meet_only)
            elif label in (HOOK, SHARED):
                hook = MeanHook(CommCounter(), None, torch.device("cpu"))
                if label == SHARED:
                    gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
                    hook.transport = SharedMemoryAllReduce(None, gradient_bytes, timeout_s=300.0)
                model.register_comm_hook(hook, run_comm_hook)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=True)

        def step(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            logits = model(inputs)
            F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        if label == SOLO and dist.get_rank() != 0:
            runs[label] = (None, lambda: None)  # idle: rank 0 is alone on the machine
        else:
            runs[label] = (None, step)
    return alternate(runs, opts["rounds"], opts["warmup"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=60, help="steps per variant")
    parser.add_argument("--batch", type=int, default=16, help="sequences per worker")
    args = parser.parse_args()
    opts = {"gpt": GPT_OPTS, "batch": args.batch, "rounds": args.rounds, "warmup": 3}
    per_rank = run_ranks(step_times, 2, opts, timeout=3600)
    params = sum(p.numel() for p in GPT(GPTConfig(**GPT_OPTS)).parameters())
    lines = [
        f"The default job's GPT ({GPT_OPTS['n_layer']} layers, d_model {GPT_OPTS['d_model']}, "
        f"{params / 1e6:.2f} M parameters, {params * 4 / 1e6:.1f} MB of fp32 gradient), "
        f"{args.batch} x {GPT_OPTS['seq_len']} tokens per worker, "
        f"AdamW; median of {args.rounds} rounds (step time: the slower rank's):",
        "",
        f"  {'variant':34s} {'step':>10s} {'efficiency':>28s} {'added':>18s}",
    ]
    for label in VARIANTS:
        step = statistics.median(slowest_rank(per_rank, label))
        # efficiency: the 1-worker step / the variant's, within each round
        low, mid, high = statistics.quantiles(paired_ratios(per_rank, SOLO, label), n=4)
        shown = f"{mid:.3f} (middle half {low:.3f}-{high:.3f})"
        added = ""
        if label in BASE:
            added = f"{paired_differences(per_rank, label, BASE[label]) * 1e3:+.2f} ms"
        lines.append(f"  {label:34s} {ms(step):>10s} {shown:>28s} {added:>18s}")
    lines += [
        "",
        "(each all-reduce row against + meeting; an efficiency of 0.95 allows a 2-worker step "
        "1.053x the 1-worker one)",
    ]
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        title = "Weak scaling taken apart: where a 2-worker step's extra time goes"
        setting = "2 ranks, gloo on loopback, CPU, 1 thread per rank"
        print(f"wrote {write_report_section(SECTION, title, report, setting)}")


if __name__ == "__main__":
    main()
