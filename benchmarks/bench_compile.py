"""torch.compile of the blocks (train.compile) on the default job: training tokens/s and the
time to the first step, eager and compiled side by side.

    python benchmarks/bench_compile.py                  # 3 rounds of 200 steps, 2 workers
    python benchmarks/bench_compile.py --precision bf16-mixed

Every compiled run starts with an empty compile cache (TORCHINDUCTOR_CACHE_DIR in a fresh
folder), so its first step pays the whole compilation, as a job's first run does. Tokens/s:
the median of the training windows in metrics.jsonl (the first, which holds start-up and
compilation, left out); the time to the first step is the trainer's `first_step` event.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, command_line, machine_line, update_section


def run(run_dir: Path, compiled: bool, steps: int, precision: str) -> dict[str, float]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor-cache"))
    args = [
        sys.executable,
        "-m",
        "dtrain",
        "train",
        "--nproc",
        "2",
        f"--run.dir={run_dir}",
        f"--train.compile={'true' if compiled else 'false'}",
        f"--train.precision={precision}",
        f"--train.steps={steps}",
        "--train.log_every=20",
        "--eval.every=0",
        "--eval.max_samples=64",
        "--checkpoint.every=0",
        "--task.generate_tokens=0",
    ]
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"compile={compiled} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [float(r["tokens_per_s"]) for r in records if r.get("kind") == "train"][1:]
    first = next(r for r in records if r.get("name") == "first_step")
    return {"tokens_per_s": statistics.median(rates), "first_step_s": float(first["seconds"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="dtrain-compile-"))
    eager: list[dict[str, float]] = []
    compiled: list[dict[str, float]] = []
    try:
        for index in range(args.rounds):
            for flag in (index % 2 == 1, index % 2 == 0):
                out = run(scratch / f"{flag}-{index}", flag, args.steps, args.precision)
                (compiled if flag else eager).append(out)
                print(
                    f"round {index} compile={flag}: {out['tokens_per_s']:.0f} tokens/s, "
                    f"first step after {out['first_step_s']:.1f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = [c["tokens_per_s"] / e["tokens_per_s"] for c, e in zip(compiled, eager)]
    lines = [
        "| train.compile | tokens/s (median) | x eager (per round) | first step after (s) |",
        "|---|---:|---:|---:|",
        f"| false | {statistics.median(r['tokens_per_s'] for r in eager):,.0f} | 1.00x "
        f"| {statistics.median(r['first_step_s'] for r in eager):.1f} |",
        f"| true | {statistics.median(r['tokens_per_s'] for r in compiled):,.0f} "
        f"| **{statistics.median(ratios):.2f}x** ({', '.join(f'{r:.2f}' for r in ratios)}) "
        f"| {statistics.median(r['first_step_s'] for r in compiled):.1f} |",
    ]
    print("\n".join(lines))
    if args.write_docs:
        body = "\n".join(
            [
                f"## torch.compile of the blocks, {args.precision} (`bench_compile.py`)",
                "",
                f"Command: `{command_line()}`  ",
                f"Machine: {machine_line()}  ",
                f"Date: {time.strftime('%Y-%m-%d')}; the default job's model, 2 workers of 1 "
                f"thread each, {args.rounds} rounds of {args.steps} steps, a cold compile cache",
                "",
                *lines,
            ]
        )
        print(f"wrote {update_section(f'bench_compile_{args.precision}', body)}")


if __name__ == "__main__":
    main()
