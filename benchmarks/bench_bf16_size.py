"""Where bf16-mixed starts to pay on this CPU: one worker's training step (forward and loss
under ``torch.autocast`` as ``train.precision = "bf16-mixed"`` runs it, backward, AdamW) of
dtrain's GPT, or a Hugging Face GPT-2 built from its config (``--model hf``), at growing
widths, fp32 and bf16-mixed alternating within each round, one thread (as each of 2 workers
on 2 cores gets).

    python benchmarks/bench_bf16_size.py                # prints the table
    python benchmarks/bench_bf16_size.py --model hf     # the same for GPT-2 (transformers)
    python benchmarks/bench_bf16_size.py --write-docs   # also updates docs/benchmarks.md

The ratio is fp32's step time over bf16-mixed's (above 1: bf16 is faster), the median over
rounds of each round's ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command_line, machine_line, update_section
from dtrain.models.gpt import GPT, GPTConfig

SECTION = "bench_bf16_size"
MODELS = {"gpt": "dtrain's GPT", "hf": "Hugging Face GPT-2 (GPT2LMHeadModel from a config)"}


def build(kind: str, width: int, layers: int, seq: int) -> torch.nn.Module:
    heads = max(4, width // 64)
    if kind == "gpt":
        cfg = GPTConfig(vocab_size=256, seq_len=seq, n_layer=layers, n_head=heads, d_model=width)
        return GPT(cfg)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads)
    return HFLogits(GPT2LMHeadModel(config))


class HFLogits(torch.nn.Module):
    """A Hugging Face causal LM as a module from token ids to logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def step_ms(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    bf16: bool,
    steps: int,
) -> float:
    """The median time of ``steps`` training steps, in ms (after one untimed step)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    times = []
    for index in range(steps + 1):
        start = time.perf_counter()
        context = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with context:
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten()
            )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if index:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt", "hf"), default="gpt")
    parser.add_argument("--widths", default="128,256,512,768,1024", help="d_model values")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="one worker's samples a step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for width in [int(w) for w in args.widths.split(",")]:
        model = build(args.model, width, args.layers, args.seq)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = torch.randint(0, 256, (args.batch, args.seq + 1))
        fp32, bf16, ratios = [], [], []
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            got = {flag: step_ms(model, optimizer, batch, flag, args.steps) for flag in order}
            fp32.append(got[False])
            bf16.append(got[True])
            ratios.append(got[False] / got[True])
        params = sum(p.numel() for p in model.parameters()) / 1e6
        row = (
            f"| {width} | {params:.1f} M | {statistics.median(fp32):.0f} ms | "
            f"{statistics.median(bf16):.0f} ms | **{statistics.median(ratios):.2f}x** "
            f"({', '.join(f'{r:.2f}' for r in ratios)}) |"
        )
        print(row, flush=True)
        rows.append(row)
    table = "\n".join(
        [
            f"{MODELS[args.model]}, {args.layers} layers, seq {args.seq}, "
            f"{args.batch} samples a step, "
            f"AdamW, one thread; {args.rounds} rounds of {args.steps} steps, fp32 and bf16-mixed "
            "alternating",
            "",
            "| d_model | parameters | fp32 step | bf16-mixed step | fp32 / bf16 (rounds) |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if args.write_docs:
        title = f"## bf16-mixed against fp32 by width: {MODELS[args.model]} (`bench_bf16_size.py`)"
        body = f"{title}\n\nCommand: `{command_line()}`  \n{machine_line()}\n\n{table}\n"
        print(f"wrote {update_section(f'{SECTION}_{args.model}', body)}")


if __name__ == "__main__":
    main()
