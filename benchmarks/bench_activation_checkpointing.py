"""Activation checkpointing (train.activation_checkpointing): the memory a training step needs
for its activations, and its time, with none, every:2 and full, side by side.

    python benchmarks/bench_activation_checkpointing.py            # 5 rounds
    python benchmarks/bench_activation_checkpointing.py --rounds 3 --steps 4

A GPT whose activations dominate its memory (6 blocks, d_model 256, 8 heads, 16 sequences of
512 tokens: 4.8 M parameters, 19 MB, against hundreds of MB of activations), one process, one
thread, AdamW; dtrain's own Recipe makes the blocks checkpointed. Each mode runs in a fresh
process, the modes alternating round by round:

- activation memory: the process's peak resident size during the steps minus its size just
  before them (model, gradients and optimizer state made by a warm-up step first), through
  the kernel's peak counter (/proc/self/status VmHWM, reset through clear_refs);
- saved for backward: the bytes the forward keeps for backward outside checkpointed blocks
  (torch's saved-tensor hooks);
- step time: the median step (forward, backward, optimizer), wall and the thread's CPU time.

Targets: full keeps <= 0.5x of none's activation memory at <= 1.4x its step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, command_line, machine_line, update_section

MODES = ("none", "every:2", "full")


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(mode: str, steps: int) -> dict[str, float]:
    """One mode, in this process: what the parent prints."""
    import torch
    import torch.nn.functional as F

    from dtrain.compute.precision import Precision
    from dtrain.config import parse_activation_checkpointing
    from dtrain.models.gpt import GPT, GPTConfig
    from dtrain.parallel.recipe import Recipe

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=512, n_layer=6, n_head=8, d_model=256)
    model = GPT(cfg)
    recipe = Recipe(Precision("fp32", torch.device("cpu")), parse_activation_checkpointing(mode))
    recipe.apply(model.blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, 256, (16, 513))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # gradients and optimizer state exist from here on
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(inputs)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved_bytes = sum(n for ptr, n in saved.items() if ptr not in params)
    del logits
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kib("VmRSS")
    times, cpu_times = [], []
    for _ in range(steps):
        started, cpu_started = time.perf_counter(), time.thread_time()
        step()
        times.append(time.perf_counter() - started)
        cpu_times.append(time.thread_time() - cpu_started)
    return {
        "activation_mib": (status_kib("VmHWM") - before) / 1024,
        "saved_mib": saved_bytes / 2**20,
        "step_s": statistics.median(times),
        "step_cpu_s": statistics.median(cpu_times),
    }


def measure(mode: str, steps: int) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--steps", str(steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    out: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for index in range(args.rounds):
        for mode in MODES[index % 3 :] + MODES[: index % 3]:
            rows[mode].append(measure(mode, args.steps))
            last = rows[mode][-1]
            print(
                f"round {index} {mode}: activations {last['activation_mib']:.0f} MiB, "
                f"saved {last['saved_mib']:.0f} MiB, step {last['step_s'] * 1e3:.0f} ms "
                f"({last['step_cpu_s'] * 1e3:.0f} ms CPU)",
                flush=True,
            )
    none = rows["none"]
    lines = [
        "| train.activation_checkpointing | activation memory (MiB) | x none | saved for "
        "backward (MiB) | step (ms) | x none (per round) | step CPU (ms) | x none (per round) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        memory = [r["activation_mib"] / b["activation_mib"] for r, b in zip(rows[mode], none)]
        time_ratio = [r["step_s"] / b["step_s"] for r, b in zip(rows[mode], none)]
        cpu_ratio = [r["step_cpu_s"] / b["step_cpu_s"] for r, b in zip(rows[mode], none)]
        lines.append(
            f"| {mode} | {statistics.median(r['activation_mib'] for r in rows[mode]):.0f} "
            f"| **{statistics.median(memory):.2f}x** "
            f"| {statistics.median(r['saved_mib'] for r in rows[mode]):.0f} "
            f"| {statistics.median(r['step_s'] for r in rows[mode]) * 1e3:.0f} "
            f"| **{statistics.median(time_ratio):.2f}x** "
            f"({', '.join(f'{t:.2f}' for t in time_ratio)}) "
            f"| {statistics.median(r['step_cpu_s'] for r in rows[mode]) * 1e3:.0f} "
            f"| **{statistics.median(cpu_ratio):.2f}x** "
            f"({', '.join(f'{t:.2f}' for t in cpu_ratio)}) |"
        )
    print("\n".join(lines))
    if args.write_docs:
        body = "\n".join(
            [
                "## Activation checkpointing (`bench_activation_checkpointing.py`)",
                "",
                f"Command: `{command_line()}`  ",
                f"Machine: {machine_line()}  ",
                f"Date: {time.strftime('%Y-%m-%d')}; {args.rounds} rounds, {args.steps} "
                "timed steps each; GPT 6 x d256, 16 x 512 tokens, one process, one thread",
                "",
                *lines,
                "",
                "Targets: full <= 0.5x none's activation memory at <= 1.4x its step time. "
                "The step's CPU time (one thread: the thread's own clock) is what the wall "
                "time would be on an idle core; a shared machine's load inflates the wall "
                "time of whichever mode it meets.",
            ]
        )
        print(f"wrote {update_section('bench_activation_checkpointing', body)}")


if __name__ == "__main__":
    main()
