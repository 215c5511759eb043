"""What one rank holds: bytes of parameters + gradients + optimizer state, ``fsdp`` against
``ddp`` (and the model-parallel strategies beside them), on 2 and 4 ranks.

Each strategy wraps the same default GPT (built from the same seed) on every rank; one AdamW
step on a real batch fills the gradients and the optimizer state. Then every rank counts the
bytes of the tensors it holds: its parameters (a DTensor counts its local shard), their
gradients, and every tensor of the optimizer state (AdamW: two moments per parameter and a
step counter). ``ddp`` holds everything on every rank; ``fsdp`` should hold about 1/N of it
(each tensor cut in N along its first dimension; the step counters are not sharded).

``pipeline`` cuts the GPT's 5 layers (embeddings, 3 blocks, norm + head) into equal layer
counts, so its stages differ in size, and both end stages hold the tied embedding/head weight;
``tensor`` cuts the attention and MLP weights and replicates embeddings and norms.

The counts are exact, so one measurement is the figure (no repeats are needed). What FSDP
gathers transiently (one block's full parameters during its forward and backward) is not held
between steps and is not counted; the bf16/fp32 policy is fp32 here.

    .venv/bin/python benchmarks/bench_sharding.py               # prints the figures
    .venv/bin/python benchmarks/bench_sharding.py --write-docs  # also updates docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout

SECTION = "bench_sharding"
STRATEGIES = ("ddp", "fsdp", "pipeline", "tensor")


def local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def held_bytes(strategy: Any, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(strategy.parameters())
    state = [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(v) for v in state),
    }


def rank_main(name: str, model_opts: dict[str, int], rows: int) -> dict[str, int]:
    from dtrain.compute.optim import build_optimizer
    from dtrain.config.load import build_config
    from dtrain.dist.runtime import init_runtime
    from dtrain.models.gpt import GPT, GPTConfig
    from dtrain.parallel import build_strategy
    from dtrain.task import Task
    from dtrain.tasks.gpt import lm_loss
    from dtrain.train.step import run_micro_batches

    world = dist.get_world_size()
    raw: dict[str, Any] = {
        "strategy": {"name": name, "pipeline_balance": "uniform"},
        "data": {"global_batch_size": rows * world, "micro_batches": world},
        "optim": {"name": "adamw"},
    }
    cfg = build_config(raw)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**model_opts))
    strategy = build_strategy(cfg, init_runtime(cfg.dist))
    strategy.setup(Task(model=model, train_data=[], loss_fn=lm_loss))
    optimizer = build_optimizer(strategy.named_parameters(), cfg.optim)
    generator = torch.Generator().manual_seed(dist.get_rank())
    seq = model_opts["seq_len"]
    per_rank = cfg.data.global_batch_size // strategy.data_parallel_size
    micro = per_rank // cfg.data.micro_batches
    batches = [
        (
            torch.randint(0, 256, (micro, seq), generator=generator),
            torch.randint(0, 256, (micro, seq), generator=generator),
        )
        for _ in range(cfg.data.micro_batches)
    ]
    scale = torch.tensor(1.0 / (micro * seq * cfg.data.micro_batches * world))
    strategy.before_first_step(batches[0], lm_loss)
    run_micro_batches(strategy, batches, lm_loss, scale)
    strategy.sync_gradients()
    optimizer.step()  # creates the AdamW moments; gradients stay (not zeroed) to be counted
    return held_bytes(strategy, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    from tests.ranks import run_ranks

    model_opts = {"vocab_size": 256, "seq_len": 128, "n_layer": 3, "n_head": 4, "d_model": 192}
    started = time.time()
    lines = []
    for world in args.worlds:
        held = {name: run_ranks(rank_main, world, name, model_opts, 4) for name in STRATEGIES}
        totals = {name: [sum(r.values()) for r in ranks] for name, ranks in held.items()}
        base = totals["ddp"][0]
        lines.append(f"{world} ranks: bytes held per rank (parameters + gradients + optimizer)")
        for name in STRATEGIES:
            parts = held[name][0]
            ratios = [t / base for t in totals[name]]
            lines.append(
                f"  {name:<8} rank 0: {parts['parameters'] / 2**20:6.2f} + "
                f"{parts['gradients'] / 2**20:6.2f} + {parts['optimizer'] / 2**20:6.2f} MiB = "
                f"{totals[name][0] / 2**20:6.2f} MiB;  /ddp per rank: "
                + " ".join(f"{r:.3f}" for r in ratios)
                + f"  (max {max(ratios):.3f}; 1/N = {1 / world:.3f})"
            )
    head = (
        f"default GPT ({', '.join(f'{k}={v}' for k, v in model_opts.items())}), AdamW, fp32, "
        f"after one step; {time.time() - started:.0f} s"
    )
    text = "\n".join([head, *lines])
    print(text)
    if args.write_docs:
        title = "Bytes per rank: fsdp vs ddp (and the model-parallel strategies)"
        print(f"wrote {write_report_section(SECTION, title, text)}")


if __name__ == "__main__":
    main()
