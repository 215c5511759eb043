"""The default job, measured: wall time and final validation loss of `dtrain train` (2 workers),
and training throughput with 1 worker against 2 workers on the same machine.

    python benchmarks/bench_default_job.py                 # the full job once, then throughput
    python benchmarks/bench_default_job.py --repeats 3     # more throughput rounds

Throughput runs are the same job shortened (no evaluation, no checkpoints in between, no text
generation), 1 and 2 workers alternating round by round; tokens/s is read from metrics.jsonl
(training windows only, the first window, which holds start-up, left out).
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
from _report import ROOT, command_line, machine, update_section


def dtrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dtrain", "train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def records(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def full_job(scratch: Path) -> dict[str, float]:
    run_dir = scratch / "full"
    started = time.perf_counter()
    result = dtrain("--nproc", "2", f"--run.dir={run_dir}")
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"the default job failed:\n{result.stderr[-3000:]}")
    summary = [r for r in records(run_dir) if r.get("kind") == "summary"][-1]
    first_eval = next(r for r in records(run_dir) if r.get("kind") == "train")
    return {
        "wall_s": wall,
        "val_loss": float(summary["val_loss"]),  # type: ignore[arg-type]
        "train_loss": float(summary["train_loss"]),  # type: ignore[arg-type]
        "first_loss": float(first_eval["loss"]),  # type: ignore[arg-type]
    }


def throughput(scratch: Path, nproc: int, steps: int, round_index: int) -> float:
    run_dir = scratch / f"tp-{nproc}-{round_index}"
    result = dtrain(
        "--nproc",
        str(nproc),
        f"--run.dir={run_dir}",
        f"--train.steps={steps}",
        "--train.log_every=25",
        "--eval.every=0",
        "--eval.max_samples=64",
        "--checkpoint.every=0",
        "--task.generate_tokens=0",
    )
    if result.returncode != 0:
        raise SystemExit(f"the {nproc}-worker run failed:\n{result.stderr[-3000:]}")
    rates = [
        float(r["tokens_per_s"])  # type: ignore[arg-type]
        for r in records(run_dir)
        if r.get("kind") == "train"
    ][1:]
    shutil.rmtree(run_dir, ignore_errors=True)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="throughput rounds")
    parser.add_argument("--steps", type=int, default=200, help="steps per throughput run")
    parser.add_argument("--skip-full", action="store_true", help="only the throughput rounds")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="dtrain-default-job-"))
    lines = []
    try:
        if not args.skip_full:
            job = full_job(scratch)
            lines.append(
                f"default job, 2 workers: wall {job['wall_s']:.1f} s (target <= 180 s), "
                f"final val loss {job['val_loss']:.4f} nats/byte (target < 1.8; first logged "
                f"train loss {job['first_loss']:.3f}), final train loss {job['train_loss']:.4f}"
            )
            print(lines[-1], flush=True)
        one, two = [], []
        for index in range(args.repeats):
            one.append(throughput(scratch, 1, args.steps, index))
            two.append(throughput(scratch, 2, args.steps, index))
            print(
                f"round {index}: 1 worker {one[-1]:.0f} tok/s, 2 workers {two[-1]:.0f} tok/s",
                flush=True,
            )
        ratio = statistics.median(b / a for a, b in zip(one, two))
        lines.append(
            f"training throughput: 1 worker {statistics.median(one):.0f} tokens/s, 2 workers "
            f"{statistics.median(two):.0f} tokens/s (median of {args.repeats} rounds of "
            f"{args.steps} steps); 2 workers / 1 worker = {ratio:.2f}x"
        )
        print(lines[-1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.write_docs:
        load = " ".join(f"{x:.1f}" for x in __import__("os").getloadavg())
        body = "\n".join(
            [
                "## The default job (`bench_default_job.py`)",
                "",
                f"Command: `{command_line()}`  ",
                f"Machine: {machine()}; load average {load} when it finished  ",
                f"Date: {time.strftime('%Y-%m-%d')}",
                "",
                "```",
                *lines,
                "```",
                "",
                "One worker gets both cores' threads; two workers get one thread each and add a",
                "gradient all-reduce per step, so on 2 cores the gain from a second worker is",
                "small: the point of the 2-worker default is to exercise the distributed path.",
            ]
        )
        print(f"wrote {update_section('bench_default_job', body)}")


if __name__ == "__main__":
    main()
