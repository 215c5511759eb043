"""``prepare`` throughput on the default corpus (the Python standard library's sources), and
the time ``verify`` takes, each next to the floor it cannot beat measured in the same run:

* prepare vs reading the same files (``Path.read_bytes``): what the conversion costs on top of
  the read;
* verify vs hashing the same bytes with ``hashlib.sha256`` directly.

Files come from the page cache (one untimed pass reads them first); each figure is the median
of ``--repeats`` runs, interleaved with its baseline.

    python benchmarks/bench_prepare.py
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command_line, machine, update_section
from dtrain.data.corpus import prepare_stdlib_corpus, stdlib_dir, stdlib_files
from dtrain.data.shards import verify_dataset


def read_all(files: list[Path]) -> int:
    return sum(len(path.read_bytes()) for path in files)


def hash_all(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while block := fh.read(8 * 2**20):
                digest.update(block)
                total += len(block)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    files = stdlib_files()
    source_bytes = read_all(files)  # also warms the page cache
    timings: dict[str, list[float]] = {"read": [], "prepare": [], "hash": [], "verify": []}
    dataset_bytes = 0
    for _ in range(args.repeats):
        started = time.perf_counter()
        read_all(files)
        timings["read"].append(time.perf_counter() - started)
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-prepare-") as tmp:
            root = Path(tmp)
            started = time.perf_counter()
            out = prepare_stdlib_corpus(root)
            timings["prepare"].append(time.perf_counter() - started)
            splits = [out / "train", out / "val"]
            shard_files = [p for s in splits for p in sorted(s.glob("*.npy"))]
            dataset_bytes = sum(p.stat().st_size for p in shard_files)
            started = time.perf_counter()
            hash_all(shard_files)
            timings["hash"].append(time.perf_counter() - started)
            started = time.perf_counter()
            bad = [b for s in splits for b in verify_dataset(s)]
            timings["verify"].append(time.perf_counter() - started)
            assert not bad, bad
            shutil.rmtree(out)
    med = {k: statistics.median(v) for k, v in timings.items()}
    mb = source_bytes / 1e6
    lines = [
        "## `prepare` and `verify` on the default corpus (`bench_prepare.py`)",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Corpus: {len(files):,} `.py` files of {stdlib_dir()}, {mb:.1f} MB, page cache warm; "
        f"the prepared train + val datasets hold {dataset_bytes / 1e6:.1f} MB of shards. "
        f"Median of {args.repeats} runs.",
        "",
        "| step | time | throughput | baseline | baseline time | dtrain / baseline |",
        "|---|---:|---:|---|---:|---:|",
        f"| prepare (train + val) | {med['prepare']:.2f} s | {mb / med['prepare']:.0f} MB/s | "
        f"reading the files | {med['read']:.2f} s | {med['read'] / med['prepare']:.2f}x |",
        f"| verify (train + val) | {med['verify']:.2f} s | "
        f"{dataset_bytes / 1e6 / med['verify']:.0f} MB/s | sha256 of the shard files | "
        f"{med['hash']:.2f} s | {med['hash'] / med['verify']:.2f}x |",
        "",
        f"- measured {time.strftime('%Y-%m-%d')}",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_doc:
        print(f"\nwrote {update_section('bench_prepare', text)}")


if __name__ == "__main__":
    main()
