"""The gradient all-reduce between the ranks of one machine: gloo on loopback against dtrain's
shared-memory segment (``comm.transport``; ``dtrain.ext.shm``).

One summing all-reduce of an fp32 tensor, timed alone: both ranks pass a barrier, then each
times its call, and a call's time in a round is that of the slower rank. The two transports
alternate round by round (A B / B A ...), on the same tensors; a ratio is the median over
rounds of the ratio within a round. Sizes: a small bucket, the 600 KB gradient of
``benchmarks/peers.py``'s MLP, the 5.6 MB gradient of the default job's GPT, and 32 MB (four
chunks of the segment's largest slot). With ``--ranks 3`` (or more) on two cores the ranks
outnumber the cores, as in the test suite.

    .venv/bin/python benchmarks/bench_shm_allreduce.py             # prints the figures
    .venv/bin/python benchmarks/bench_shm_allreduce.py --write-docs  # and docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.ext.shm import SharedMemoryAllReduce

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import run_ranks

from bench_allreduce import Run, alternate, describe, median_of, paired_ratios

SECTION = "bench_shm_allreduce"
SIZES = {
    "64 KB": 16 * 1024,
    "600 KB (peers.py's MLP)": 150_000,
    "5.6 MB (the default GPT)": 1_410_000,
    "32 MB (4 chunks)": 8 * 1024 * 1024,
}


def call_times(opts: dict[str, Any]) -> dict[str, list[float]]:
    numel = opts["numel"]
    shared = SharedMemoryAllReduce(None, numel * 4, timeout_s=300.0)
    source = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    tensors = {"gloo": source.clone(), "shm": source.clone()}

    def reset(name: str) -> None:
        tensors[name].copy_(source)

    def by_gloo() -> None:
        dist.all_reduce(tensors["gloo"])

    def by_shm() -> None:
        shared.all_reduce_(tensors["shm"])

    runs: dict[str, Run] = {
        "gloo": (lambda: reset("gloo"), by_gloo),
        "shm": (lambda: reset("shm"), by_shm),
    }
    times = alternate(runs, opts["rounds"], warmup=3)
    if not torch.equal(tensors["gloo"], tensors["shm"]) and dist.get_world_size() == 2:
        raise AssertionError("two ranks: the segment's sum must equal gloo's bit for bit")
    shared.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=60, help="calls per transport and size")
    parser.add_argument("--ranks", default="2,3", help="comma-separated numbers of ranks")
    args = parser.parse_args()
    lines = [
        f"One fp32 all-reduce, the slower rank's time, median of {args.rounds} rounds "
        "(ratio: shm / gloo within a round; middle half of the rounds):"
    ]
    for ranks in [int(r) for r in args.ranks.split(",") if r]:
        lines.append(f"  {ranks} ranks:")
        for label, numel in SIZES.items():
            per_rank = run_ranks(
                call_times, ranks, {"numel": numel, "rounds": args.rounds}, timeout=1800
            )
            gloo, shm = median_of(per_rank, "gloo"), median_of(per_rank, "shm")
            ratio = describe(paired_ratios(per_rank, "shm", "gloo"), 3)
            lines.append(
                f"    {label:<26} gloo {gloo * 1e3:7.3f} ms   shm {shm * 1e3:7.3f} ms   "
                f"shm/gloo {ratio}"
            )
            print(lines[-1], flush=True)
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        title = "The all-reduce between ranks of one machine: gloo against shared memory"
        setting = "gloo on loopback, CPU, 1 thread per rank"
        print(f"wrote {write_report_section(SECTION, title, report, setting)}")


if __name__ == "__main__":
    main()
