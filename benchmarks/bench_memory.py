"""Anonymous memory of a rank streaming a dataset 4x larger than another.

Shards are memory-mapped, so what a rank reads is file-backed page cache (RssFile), which the
kernel can drop at will; its own anonymous memory (RssAnon: heap, arrays it allocated) should not
grow with the dataset. Each run is a fresh process that streams one full epoch of a dataset
(all of it: a world of one rank) and records the peak RssAnon, sampled after every step.

The baseline loads the same ``.npy`` data with ``np.load`` (no memory map) behind a DataLoader,
as code written for small datasets does.

    python benchmarks/bench_memory.py      # writes ~80 MB and ~330 MB datasets under /tmp
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command_line, machine, rss_anon_kib, update_section

PER_STEP = 256


def build(root: Path, n: int, sample_bytes: int) -> Path:
    import numpy as np

    from dtrain.data.shards import ShardWriter

    out = root / f"{n}x{sample_bytes}"
    if (out / "manifest.json").exists():
        return out
    rng = np.random.default_rng(n)
    with ShardWriter(out, overwrite=True) as writer:
        for begin in range(0, n, 8192):
            end = min(n, begin + 8192)
            x = rng.integers(0, 256, (end - begin, sample_bytes), dtype=np.uint8)
            writer.write_rows({"x": x, "y": np.arange(begin, end, dtype=np.int64)})
    return out


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(kind: str, data: str) -> dict[str, float]:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, default_collate

    from dtrain.data.loader import RankLoader
    from dtrain.data.partition import OrderSpec
    from dtrain.data.shards import ShardedDataset

    torch.set_num_threads(1)
    dataset = ShardedDataset(data)
    n = len(dataset)
    start = rss_anon_kib()
    peak = start
    checksum = 0
    if kind == "dtrain":
        loader = RankLoader(
            dataset,
            order=OrderSpec(n, seed=0, shard_sizes=dataset.shard_sizes),
            global_batch_size=PER_STEP,
            micro_batches=1,
            rank=0,
            world_size=1,
            collate_fn=default_collate,
            fingerprint=dataset.fingerprint,
        )
        for _, batch in zip(range(n // PER_STEP), loader):
            checksum += int(batch.micro[0]["x"][:, 0].sum())
            peak = max(peak, rss_anon_kib())
        loader.close()
    else:
        # Read the whole dataset into memory, as np.load without mmap_mode does.
        x = np.concatenate(
            [np.load(Path(data) / f"{s['name']}.x.npy") for s in dataset.manifest["shards"]]
        )
        rows = torch.utils.data.TensorDataset(torch.from_numpy(x))
        for batch in DataLoader(rows, batch_size=PER_STEP, shuffle=True):
            checksum += int(batch[0][:, 0].sum())
            peak = max(peak, rss_anon_kib())
    return {
        "start_kib": start,
        "peak_kib": peak,
        "file_kib": rss_kib("RssFile"),
        "checksum": checksum,
    }


def run_child(kind: str, data: Path) -> dict[str, float]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import bench_memory as b; "
        "print(json.dumps(b.child(sys.argv[2], sys.argv[3])))"
    )
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run(
        [sys.executable, "-c", code, here, kind, str(data)],
        check=True,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=20_000, help="samples of the small set")
    parser.add_argument("--sample-bytes", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default="/tmp/dtrain-bench/memory")
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    root = Path(args.root)
    sets = {
        "small": build(root, args.small, args.sample_bytes),
        "large": build(root, 4 * args.small, args.sample_bytes),
    }
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for kind in ("dtrain", "np.load"):
            for size, path in sets.items():
                results.setdefault((kind, size), []).append(run_child(kind, path))

    def peak_mib(kind: str, size: str) -> float:
        return min(r["peak_kib"] for r in results[(kind, size)]) / 1024

    def file_mib(kind: str, size: str) -> float:
        return max(r["file_kib"] for r in results[(kind, size)]) / 1024

    mb = args.sample_bytes * args.small / 1e6
    lines = [
        "## Anonymous memory vs dataset size (`bench_memory.py`)",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Data: {args.small:,} and {4 * args.small:,} samples of {args.sample_bytes} B "
        f"({mb:.0f} MB and {4 * mb:.0f} MB); one fresh process per run streams a whole "
        f"epoch, {PER_STEP} samples per step; peak RssAnon sampled after every step, "
        f"lowest of {args.repeats} runs.",
        "",
        "| loader | peak RssAnon, small | peak RssAnon, 4x larger | ratio | RssFile at the "
        "end, 4x larger |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, label in (
        ("dtrain", "dtrain RankLoader (memory-mapped shards)"),
        ("np.load", "np.load into memory + DataLoader"),
    ):
        small, large = peak_mib(kind, "small"), peak_mib(kind, "large")
        lines.append(
            f"| {label} | {small:.0f} MiB | {large:.0f} MiB | {large / small:.2f}x | "
            f"{file_mib(kind, 'large'):.0f} MiB |"
        )
    ratio = peak_mib("dtrain", "large") / peak_mib("dtrain", "small")
    lines += [
        "",
        f"- target: at most 1.1x; measured {ratio:.2f}x ({'met' if ratio <= 1.1 else 'MISSED'})",
        f"- measured {time.strftime('%Y-%m-%d')}",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_doc:
        print(f"\nwrote {update_section('bench_memory', text)}")


if __name__ == "__main__":
    main()
