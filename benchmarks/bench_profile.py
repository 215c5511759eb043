"""What ``train.profile`` costs outside its window: the default job's step time with profiling
configured for other steps against profiling not configured (issue 43).

Both variants train the default job (a 1.4 M-parameter byte-level GPT) for ``--steps`` steps on
2 ranks (ddp, gloo on loopback), in one launch, rounds alternating the order: ``off``
(``train.profile = 'none'``) and ``elsewhere`` (``train.profile = 'steps:N'``, the last step:
the window opens after every measured step). The figure is the median over rounds of the
ratio of the two runs' median step time (the train records' ``step_time_s``, every step
logged, steps 2 to N - 1). Outside the window the loop holds no profiler and compares one
integer per step boundary, so the expected ratio is 1 within the machine's noise.

    .venv/bin/python benchmarks/bench_profile.py                 # prints the figures
    .venv/bin/python benchmarks/bench_profile.py --write-docs    # also updates docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import run_ranks

VARIANTS = ("off", "elsewhere")


def step_times(root: str, steps: int, rounds: int) -> list[dict[str, float]]:
    """In each rank: each round trains both variants; rank 0's median step time of each."""
    from dtrain.train.job import build_job_config, build_trainer

    measured = []
    for round_ in range(rounds):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        times: dict[str, float] = {}
        for variant in order:
            run_dir = Path(root) / f"{variant}-{round_}"
            profile = "none" if variant == "off" else f"steps:{steps}"
            raw = {
                "run": {"dir": str(run_dir)},
                "train": {"steps": steps, "log_every": 1, "profile": profile},
                "eval": {"every": 0, "max_samples": 64},
                "checkpoint": {"every": 0},
            }
            build_trainer(build_job_config(raw)).fit()
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            train = [r["step_time_s"] for r in records if r.get("kind") == "train"]
            times[variant] = statistics.median(train[1:-1])
        measured.append(times)
    return measured


def report(measured: list[dict[str, Any]], steps: int) -> str:
    ratios = [m["elsewhere"] / m["off"] for m in measured]
    off = statistics.median(m["off"] for m in measured)
    return "\n".join(
        [
            f"default job, ddp on 2 ranks, {steps} steps per run, {len(measured)} rounds",
            "",
            "| | median step | ratio to off (median over rounds) | ratios, min-max |",
            "|---|---|---|---|",
            f"| `train.profile = 'none'` | {off * 1e3:.1f} ms | 1 | |",
            f"| `train.profile = 'steps:{steps}'` (other steps) | "
            f"{statistics.median(m['elsewhere'] for m in measured) * 1e3:.1f} ms | "
            f"{statistics.median(ratios):.3f}x | {min(ratios):.3f}-{max(ratios):.3f} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="dtrain-bench-profile-")
    try:
        measured = run_ranks(step_times, 2, root, args.steps, args.rounds, timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(measured, args.steps)
    print(text)
    if args.write_docs:
        write_report_section(
            "bench_profile",
            "Profiling configured for other steps (`bench_profile.py`)",
            text,
            "2 ranks (gloo), one thread each",
        )


if __name__ == "__main__":
    main()
