"""Time to the first batch after a resume: at stream position 10 and at 10,000,000.

dtrain's loader resumes by computing the plan at the saved position (the state is one number),
so the time should not depend on the position. The baseline is the usual way without a
stateful loader: torch ``DataLoader`` + ``DistributedSampler``, skipping the batches before the
position (as ``accelerate``'s ``skip_first_batches`` does), which costs time in proportion.

Each measurement runs in a fresh process (imports, opening the dataset, building the loader,
loading the state, the first batch), alternating the two positions, ``--repeats`` times.

    python benchmarks/bench_resume.py      # writes a 12M-sample dataset (~100 MB) under /tmp
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
from _report import command_line, machine, update_section

WORLD, RANK, PER_RANK = 4, 1, 256


def build(root: Path, n: int) -> Path:
    import numpy as np

    from dtrain.data.shards import ShardWriter

    out = root / f"ids-{n}"
    if (out / "manifest.json").exists():
        return out
    with ShardWriter(out, overwrite=True) as writer:
        for begin in range(0, n, 1 << 20):
            end = min(n, begin + (1 << 20))
            writer.write_rows({"id": np.arange(begin, end, dtype=np.int64)})
    return out


def child_dtrain(data: str, position: int) -> dict[str, float]:
    """In a fresh process: resume a rank's loader at ``position``; seconds to the first batch."""
    started = time.perf_counter()
    from torch.utils.data import default_collate

    from dtrain.data.loader import RankLoader
    from dtrain.data.partition import OrderSpec
    from dtrain.data.shards import ShardedDataset

    dataset = ShardedDataset(data)
    loader = RankLoader(
        dataset,
        order=OrderSpec(len(dataset), seed=0, shard_sizes=dataset.shard_sizes),
        global_batch_size=WORLD * PER_RANK,
        micro_batches=1,
        rank=RANK,
        world_size=WORLD,
        collate_fn=default_collate,
        fingerprint=dataset.fingerprint,
    )
    state = loader.state_dict() | {"consumed": position}
    loader.load_state_dict(state)
    batch = next(loader)
    first = time.perf_counter() - started
    assert batch.plan.start == position and len(batch.micro[0]["id"]) == PER_RANK
    loader.close()
    return {"seconds": first}


def child_replay(data: str, position: int, limit: float) -> dict[str, float]:
    """The baseline: DataLoader + DistributedSampler, skipping the batches before ``position``
    (each rank skips ``position / world`` samples). Gives up after ``limit`` seconds."""
    started = time.perf_counter()
    from torch.utils.data import DataLoader, DistributedSampler

    from dtrain.data.shards import ShardedDataset

    dataset = ShardedDataset(data)
    sampler = DistributedSampler(dataset, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0)
    loader = iter(DataLoader(dataset, batch_size=PER_RANK, sampler=sampler))
    skip = position // (WORLD * PER_RANK)
    for done in range(skip):
        next(loader)
        if done % 64 == 0 and time.perf_counter() - started > limit:
            return {"seconds": float("inf"), "skipped": done}
    next(loader)
    return {"seconds": time.perf_counter() - started}


def run_child(kind: str, data: Path, position: int, limit: float) -> float:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import bench_resume as b; "
        "kind, data, pos, limit = sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]); "
        "r = b.child_dtrain(data, pos) if kind == 'dtrain' else b.child_replay(data, pos, limit); "
        "print(json.dumps(r))"
    )
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run(
        [sys.executable, "-c", code, here, kind, str(data), str(position), str(limit)],
        check=True,
        capture_output=True,
        text=True,
        timeout=limit + 120,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=12_000_000)
    parser.add_argument("--near", type=int, default=10)
    parser.add_argument("--far", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-limit", type=float, default=120.0, help="seconds")
    parser.add_argument("--root", default="/tmp/dtrain-bench/resume")
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    if args.far >= args.samples:
        parser.error("--far must lie inside the first epoch (< --samples)")
    data = build(Path(args.root), args.samples)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for position in (args.near, args.far):
            times.setdefault(("dtrain", position), []).append(
                run_child("dtrain", data, position, args.baseline_limit)
            )
    for position in (args.near, args.far):  # once each: it is slow by design
        times[("replay", position)] = [run_child("replay", data, position, args.baseline_limit)]
    med = {key: statistics.median(v) for key, v in times.items()}

    def shown(seconds: float) -> str:
        return f"> {args.baseline_limit:.0f} s" if seconds == float("inf") else f"{seconds:.2f} s"

    gap = med[("dtrain", args.far)] - med[("dtrain", args.near)]
    lines = [
        "## Time to first batch after a resume (`bench_resume.py`)",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Data: {args.samples:,} samples (one int64 each), rank {RANK} of {WORLD}, "
        f"{PER_RANK} samples per rank per step, full shuffle. Each figure is a fresh process "
        "(imports + open + state + first batch); dtrain: median of "
        f"{args.repeats}, the baseline: one run.",
        "",
        f"| method | resume at {args.near:,} | resume at {args.far:,} | difference |",
        "|---|---:|---:|---:|",
        f"| dtrain RankLoader (`load_state_dict`) | {shown(med[('dtrain', args.near)])} | "
        f"{shown(med[('dtrain', args.far)])} | {gap:+.2f} s |",
        f"| DataLoader + DistributedSampler, skipping batches | "
        f"{shown(med[('replay', args.near)])} | {shown(med[('replay', args.far)])} | "
        f"{med[('replay', args.far)] - med[('replay', args.near)]:+.2f} s |",
        "",
        "dtrain runs: "
        + "; ".join(
            f"at {p:,}: " + ", ".join(f"{t:.2f}" for t in times[("dtrain", p)])
            for p in (args.near, args.far)
        ),
        "",
        f"- target: within 1 s of each other; measured {gap:+.2f} s "
        f"({'met' if abs(gap) <= 1.0 else 'MISSED'})",
        f"- measured {time.strftime('%Y-%m-%d')}",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_doc:
        print(f"\nwrote {update_section('bench_resume', text)}")


if __name__ == "__main__":
    main()
