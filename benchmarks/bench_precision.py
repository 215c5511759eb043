"""Mixed precision on the default job: tokens/s and final validation loss of `dtrain train`
(2 workers) with train.precision = fp32, bf16-mixed and fp16-mixed, side by side.

    python benchmarks/bench_precision.py                  # the whole default job, then speed
    python benchmarks/bench_precision.py --loss-steps 200 --rounds 3

Two parts, because they need different things of a shared machine. The final validation loss
is deterministic (the same bits under any load), so each precision trains the whole default
job once (700 steps). Tokens/s is not: the machine's load moves a long run's speed by 2x
here, so speed is measured in short runs (--speed-steps, no evaluation or checkpoints), the
precisions alternating, their order rotating from round to round; each run's figure is the
median of its training windows (the first, which holds start-up, left out) and the ratio
to fp32 is taken within each round. Targets: bf16-mixed >= 1.6x fp32's tokens/s, its final
validation loss <= 1.01x fp32's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, command_line, machine_line, update_section

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
# fp16's whole job is left out by default: a CPU without fp16 arithmetic (this one) runs it
# about 5x slower than fp32, over an hour for the default job. --whole-fp16 includes it.
WHOLE = ("fp32", "bf16-mixed")


def run(run_dir: Path, precision: str, steps: int, *extra: str) -> dict[str, float]:
    args = [
        sys.executable,
        "-m",
        "dtrain",
        "train",
        "--nproc",
        "2",
        f"--run.dir={run_dir}",
        f"--train.precision={precision}",
        f"--train.steps={steps}",
        "--task.generate_tokens=0",
        *extra,
    ]
    for attempt in range(2):  # a run that fails on this shared machine is shown, and run again
        shutil.rmtree(run_dir, ignore_errors=True)
        result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False)
        if result.returncode == 0:
            break
        print(f"{precision} failed (attempt {attempt + 1}):\n{result.stderr[-3000:]}", flush=True)
    else:
        raise SystemExit(f"{precision} failed twice")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [float(r["tokens_per_s"]) for r in records if r.get("kind") == "train"][1:]
    summary = [r for r in records if r.get("kind") == "summary"][-1]
    overflows = sum(1 for r in records if r.get("name") == "overflow")
    return {
        "tokens_per_s": statistics.median(rates),
        "val_loss": float(summary.get("val_loss") or "nan"),
        "overflows": overflows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss-steps", type=int, default=700, help="the default job's 700")
    parser.add_argument("--rounds", type=int, default=4, help="speed rounds")
    parser.add_argument("--speed-steps", type=int, default=60)
    parser.add_argument("--whole-fp16", action="store_true", help="fp16's whole job too")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="dtrain-precision-"))
    whole: dict[str, dict[str, float]] = {}
    speed: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    try:
        for precision in PRECISIONS if args.whole_fp16 else WHOLE:
            whole[precision] = run(scratch / f"{precision}-whole", precision, args.loss_steps)
            print(f"{precision}: val loss {whole[precision]['val_loss']:.4f}", flush=True)
        quiet = ("--eval.every=0", "--checkpoint.every=0")
        for index in range(args.rounds):
            order = PRECISIONS[index % 3 :] + PRECISIONS[: index % 3]
            for precision in order:
                out = run(scratch / f"{precision}-{index}", precision, args.speed_steps, *quiet)
                speed[precision].append(out["tokens_per_s"])
                print(f"round {index} {precision}: {out['tokens_per_s']:.0f} tokens/s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [
        "| train.precision | tokens/s (median of rounds) | x fp32 (median; per round) "
        "| final val loss | x fp32's loss | fp16 overflows skipped |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for precision in PRECISIONS:
        ratios = [r / b for r, b in zip(speed[precision], speed["fp32"])]
        if precision not in whole:
            lines.append(
                f"| {precision} | {statistics.median(speed[precision]):,.0f} "
                f"| **{statistics.median(ratios):.2f}x** ({', '.join(f'{x:.2f}' for x in ratios)}) "
                "| not run (--whole-fp16) | | |"
            )
            continue
        lines.append(
            f"| {precision} | {statistics.median(speed[precision]):,.0f} "
            f"| **{statistics.median(ratios):.2f}x** ({', '.join(f'{x:.2f}' for x in ratios)}) "
            f"| {whole[precision]['val_loss']:.4f} "
            f"| {whole[precision]['val_loss'] / whole['fp32']['val_loss']:.4f}x "
            f"| {whole[precision]['overflows']:.0f} |"
        )
    print("\n".join(lines))
    if args.write_docs:
        body = "\n".join(
            [
                "## Mixed precision on the default job (`bench_precision.py`)",
                "",
                f"Command: `{command_line()}`  ",
                f"Machine: {machine_line()}  ",
                f"Date: {time.strftime('%Y-%m-%d')}; 2 workers of 1 thread each; the loss "
                f"after the whole job ({args.loss_steps} steps), tokens/s over {args.rounds} "
                f"rounds of {args.speed_steps} steps",
                "",
                *lines,
                "",
                "Targets: bf16-mixed >= 1.6x fp32's tokens/s at a final validation loss <= "
                "1.01x fp32's.",
            ]
        )
        print(f"wrote {update_section('bench_precision', body)}")


if __name__ == "__main__":
    main()
