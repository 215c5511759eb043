"""Mixed precision on the default job: tokens/s and final validation loss of `dtrain train`
(2 workers) with train.precision = fp32, bf16-mixed and fp16-mixed, side by side.

    python benchmarks/bench_precision.py                  # 2 rounds, the whole default job
    python benchmarks/bench_precision.py --steps 200      # shorter runs

Each round runs every precision once, one after the other (their order rotates from round to
round, so that a slow stretch of the shared machine does not always hit the same one).
Tokens/s: the median of the training windows in metrics.jsonl (the first, which holds
start-up, left out). Targets: bf16-mixed >= 1.6x fp32's tokens/s, its final validation loss
<= 1.01x fp32's.
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


def run(run_dir: Path, precision: str, steps: int) -> dict[str, float]:
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
    ]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{precision} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [float(r["tokens_per_s"]) for r in records if r.get("kind") == "train"][1:]
    summary = [r for r in records if r.get("kind") == "summary"][-1]
    overflows = sum(1 for r in records if r.get("name") == "overflow")
    return {
        "tokens_per_s": statistics.median(rates),
        "val_loss": float(summary["val_loss"]),
        "overflows": overflows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=700, help="the default job's 700")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="dtrain-precision-"))
    results: dict[str, list[dict[str, float]]] = {p: [] for p in PRECISIONS}
    try:
        for index in range(args.rounds):
            order = PRECISIONS[index % 3 :] + PRECISIONS[: index % 3]
            for precision in order:
                out = run(scratch / f"{precision}-{index}", precision, args.steps)
                results[precision].append(out)
                print(
                    f"round {index} {precision}: {out['tokens_per_s']:.0f} tokens/s, "
                    f"val loss {out['val_loss']:.4f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = results["fp32"]
    lines = [
        "| train.precision | tokens/s (median of rounds) | x fp32 (per round) | final val loss "
        "| x fp32's loss | fp16 overflows skipped |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for precision in PRECISIONS:
        rows = results[precision]
        speed = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rows, base)]
        loss = [r["val_loss"] / b["val_loss"] for r, b in zip(rows, base)]
        lines.append(
            f"| {precision} | {statistics.median(r['tokens_per_s'] for r in rows):,.0f} "
            f"| **{statistics.median(speed):.2f}x** ({', '.join(f'{s:.2f}' for s in speed)}) "
            f"| {statistics.median(r['val_loss'] for r in rows):.4f} "
            f"| {statistics.median(loss):.4f}x "
            f"| {statistics.median(r['overflows'] for r in rows):.0f} |"
        )
    print("\n".join(lines))
    if args.write_docs:
        body = "\n".join(
            [
                "## Mixed precision on the default job (`bench_precision.py`)",
                "",
                f"Command: `{command_line()}`  ",
                f"Machine: {machine_line()}  ",
                f"Date: {time.strftime('%Y-%m-%d')}; {args.rounds} rounds of {args.steps} "
                "steps, 2 workers of 1 thread each",
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
