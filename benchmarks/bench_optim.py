"""The optimizer's kernels on the default job: optim.implementation = foreach (the default)
against fused, side by side -- tokens/s of `dtrain train` (2 workers) in fp32 and bf16-mixed,
and the default GPT's AdamW step alone in one process.

    python benchmarks/bench_optim.py
    python benchmarks/bench_optim.py --rounds 2 --write-docs

Each round runs the four jobs (2 precisions x 2 implementations) in a rotating order, as short
runs (--speed-steps, no evaluation or checkpoints); each run's figure is the median of its
training windows (the first, which holds start-up, left out) and fused's ratio to foreach is
taken within the round. The step alone: AdamW over the default GPT's parameters with fixed
gradients, one thread, the two implementations alternating, median milliseconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command_line, machine_line, update_section
from bench_precision import run

IMPLEMENTATIONS = ("foreach", "fused")
PRECISIONS = ("fp32", "bf16-mixed")


def step_ms(repeats: int, steps: int) -> dict[str, float]:
    """Median ms of one AdamW step over the default GPT's parameters, per implementation."""
    import torch

    from dtrain.compute.optim import build_optimizer
    from dtrain.config import OptimConfig
    from dtrain.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {kind: [] for kind in IMPLEMENTATIONS}
    optimizers = {}
    for kind in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        for param in model.parameters():
            param.grad = torch.randn_like(param) * 1e-3
        cfg = OptimConfig(implementation=kind)  # type: ignore[arg-type]
        optimizers[kind] = build_optimizer(model.named_parameters(), cfg)
        optimizers[kind].step()  # the state is made in the first step
    for _ in range(repeats):
        for kind in IMPLEMENTATIONS:
            started = time.perf_counter()
            for _ in range(steps):
                optimizers[kind].step()
            times[kind].append((time.perf_counter() - started) / steps * 1e3)
    return {kind: statistics.median(values) for kind, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speed-steps", type=int, default=60)
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    alone = step_ms(repeats=5, steps=20)
    print(f"AdamW step alone: {alone}", flush=True)
    jobs = [(p, k) for p in PRECISIONS for k in IMPLEMENTATIONS]
    speed: dict[tuple[str, str], list[float]] = {job: [] for job in jobs}
    quiet = ("--eval.every=0", "--checkpoint.every=0")
    with tempfile.TemporaryDirectory(prefix="dtrain-optim-") as scratch:
        for index in range(args.rounds):
            for precision, kind in jobs[index % 4 :] + jobs[: index % 4]:
                run_dir = Path(scratch) / f"{precision}-{kind}-{index}"
                extra = (f"--optim.implementation={kind}", *quiet)
                out = run(run_dir, precision, args.speed_steps, *extra)
                speed[(precision, kind)].append(out["tokens_per_s"])
                print(f"round {index} {precision} {kind}: {out['tokens_per_s']:.0f} tokens/s")
    lines = [
        "| train.precision | foreach tokens/s | fused tokens/s "
        "| fused x foreach (median; per round) |",
        "|---|---:|---:|---:|",
    ]
    for precision in PRECISIONS:
        base, fused = speed[(precision, "foreach")], speed[(precision, "fused")]
        ratios = [f / b for f, b in zip(fused, base)]
        lines.append(
            f"| {precision} | {statistics.median(base):,.0f} | {statistics.median(fused):,.0f} "
            f"| **{statistics.median(ratios):.2f}x** ({', '.join(f'{x:.2f}' for x in ratios)}) |"
        )
    bf16 = [f / b for f, b in zip(speed[("bf16-mixed", "fused")], speed[("fp32", "fused")])]
    lines += [
        "",
        f"The AdamW step alone (default GPT, one thread): foreach {alone['foreach']:.1f} ms, "
        f"fused {alone['fused']:.1f} ms ({alone['foreach'] / alone['fused']:.1f}x). With fused "
        f"kernels in both, bf16-mixed runs at **{statistics.median(bf16):.2f}x** fp32's "
        f"tokens/s (per round: {', '.join(f'{x:.2f}' for x in bf16)}).",
    ]
    print("\n".join(lines))
    if args.write_docs:
        body = "\n".join(
            [
                "## The optimizer's kernels (`bench_optim.py`)",
                "",
                f"Command: `{command_line()}`  ",
                f"Machine: {machine_line()}  ",
                f"Date: {time.strftime('%Y-%m-%d')}; the default job, 2 workers of 1 thread "
                f"each; tokens/s over {args.rounds} rounds of {args.speed_steps} steps",
                "",
                *lines,
            ]
        )
        print(f"wrote {update_section('bench_optim', body)}")


if __name__ == "__main__":
    main()
