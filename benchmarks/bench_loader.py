"""Per-rank loader throughput: dtrain's RankLoader against the baselines, on the same samples.

* raw NumPy: ``memmap[ids]`` of one ``.npy`` holding every sample, for the same ids as the
  rank's plan (the floor any loader pays: one copy out of the page cache);
* torch ``DataLoader`` + ``DistributedSampler`` over that memmap (a map-style Dataset returning
  one sample per ``__getitem__``, default collate), the usual way to do it;
* mosaicml-streaming (``StreamingDataset`` over the same samples written as MDS), when it is
  installed (``pip install -e '.[bench]'``; in one process, so it reads as a single rank).

All read from a warm page cache (each file is read once before timing): the figures measure the
loader, not the disk. Each method runs ``--repeats`` times, interleaved; medians are reported.

    python benchmarks/bench_loader.py            # ~330 MB of 4 KiB samples under /tmp
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command_line, machine, update_section
from dtrain.data.loader import RankLoader
from dtrain.data.partition import OrderSpec, plan_steps
from dtrain.data.shards import ShardedDataset, ShardWriter

SMALL_SHARD_BYTES = 2**20  # the many-shards variant: 1 MiB shards


def build(root: Path, n: int, sample_bytes: int) -> None:
    """The dataset four ways: dtrain shards (the default size, and 1 MiB shards: many of
    them), one raw .npy per field, and MDS if available."""
    if (root / "small-shards" / "manifest.json").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x_all = np.lib.format.open_memmap(root / "x.npy", "w+", np.uint8, (n, sample_bytes))
    y_all = np.lib.format.open_memmap(root / "y.npy", "w+", np.int64, (n,))
    with (
        ShardWriter(root / "shards", overwrite=True) as writer,
        ShardWriter(root / "small-shards", overwrite=True, shard_bytes=SMALL_SHARD_BYTES) as small,
    ):
        for begin in range(0, n, 8192):
            end = min(n, begin + 8192)
            x = rng.integers(0, 256, (end - begin, sample_bytes), dtype=np.uint8)
            y = np.arange(begin, end, dtype=np.int64)
            x_all[begin:end], y_all[begin:end] = x, y
            writer.write_rows({"x": x, "y": y})
            small.write_rows({"x": x, "y": y})
    x_all.flush()
    y_all.flush()
    del x_all, y_all


def import_streaming() -> Any:
    """``import streaming``. Its package __init__ imports its vision helpers, hence torchvision;
    the torchvision wheel on PyPI is a CUDA build that cannot load next to a CPU-only torch.
    Only then, a stand-in for the two torchvision names it imports at load time is put in
    place: StreamingDataset and the MDS reader measured here never use them."""
    try:
        import streaming
    except (RuntimeError, OSError):
        import types

        for name in list(sys.modules):
            if name == "torchvision" or name.startswith(("torchvision.", "streaming")):
                del sys.modules[name]
        stub = types.ModuleType("torchvision")
        datasets = types.ModuleType("torchvision.datasets")
        datasets.VisionDataset = object  # type: ignore[attr-defined]
        transforms = types.ModuleType("torchvision.transforms")
        functional = types.ModuleType("torchvision.transforms.functional")
        functional.to_tensor = None  # type: ignore[attr-defined]
        sys.modules.update(
            {
                "torchvision": stub,
                "torchvision.datasets": datasets,
                "torchvision.transforms": transforms,
                "torchvision.transforms.functional": functional,
            }
        )
        import streaming

        STUBBED.append("torchvision")
    return streaming


STUBBED: list[str] = []


def build_mds(root: Path) -> Path:
    MDSWriter = import_streaming().MDSWriter

    out = root / "mds"
    if (out / "index.json").exists():
        return out
    x = np.load(root / "x.npy", mmap_mode="r")
    y = np.load(root / "y.npy", mmap_mode="r")
    columns = {"x": f"ndarray:uint8:{x.shape[1]}", "y": "int64"}
    with MDSWriter(out=str(out), columns=columns, size_limit=64 * 2**20) as writer:
        for i in range(len(y)):
            writer.write({"x": np.asarray(x[i]), "y": int(y[i])})
    return out


def warm(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as fh:
                while fh.read(16 * 2**20):
                    pass


class RawRows(Dataset[dict[str, Any]]):
    """What a user writes for DataLoader over a memmap: one sample per call."""

    def __init__(self, root: Path) -> None:
        self.x = np.load(root / "x.npy", mmap_mode="r")
        self.y = np.load(root / "y.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i]}


def overlap_section(
    dtrain_loader: Callable[..., Callable[[], int]], step_fetch_s: float, repeats: int
) -> list[str]:
    """The prefetch thread's purpose: with a training step to overlap (matmuls, which run
    without the GIL), the fetch hides behind it. Throughput with and without the thread."""
    a = torch.randn(96, 96)
    started = time.perf_counter()
    for _ in range(200):
        a @ a
    per = (time.perf_counter() - started) / 200
    repeat_mm = max(1, round(step_fetch_s / per))  # a step about as long as its fetch

    def work() -> None:
        for _ in range(repeat_mm):
            a @ a

    sync, thread = dtrain_loader(0, work), dtrain_loader(2, work)
    runs: dict[str, list[float]] = {"sync": [], "thread": []}
    for _ in range(max(3, repeats // 3)):
        runs["sync"].append(timed(sync)[0])
        runs["thread"].append(timed(thread)[0])
    s, t = statistics.median(runs["sync"]), statistics.median(runs["thread"])
    return [
        "",
        f"With a simulated training step after each batch ({repeat_mm} x a 96x96 matmul, "
        f"about {repeat_mm * per * 1e6:.0f} µs, as long as a raw fetch): synchronous {s:,.0f} "
        f"samples/s, prefetch thread {t:,.0f} samples/s, so the thread gives {t / s:.2f}x "
        f"(median of {len(runs['sync'])}).",
        "",
        "The prefetch thread's rows above are a loop that does nothing but load: the training "
        "thread finds the queue empty at every step and sleeps until the loader thread wakes "
        "it (two context switches a step), which the synchronous loader never pays. That is "
        "why the thread is not the default on CPU; it pays off when there is a step to hide "
        "the fetch behind, as here.",
    ]


def timed(fn: Callable[[], int]) -> tuple[float, float]:
    """Samples per second of wall-clock time and of this process's CPU time (all its threads:
    steadier than wall time on a shared machine; it leaves out worker processes)."""
    wall, cpu = time.perf_counter(), time.process_time()
    items = fn()
    return items / (time.perf_counter() - wall), items / max(1e-9, time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=80_000)
    parser.add_argument("--sample-bytes", type=int, default=4096)
    parser.add_argument("--world", type=int, default=4, help="ranks the stream is cut for")
    parser.add_argument("--per-rank-batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=0, help="num_workers for both loaders")
    parser.add_argument("--epochs", type=int, default=2, help="rank epochs per timed run")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--root", default="/tmp/dtrain-bench/loader")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    root = Path(args.root) / f"{args.samples}x{args.sample_bytes}"
    build(root, args.samples, args.sample_bytes)
    mds_error = ""
    try:
        mds = build_mds(root)
    except Exception as exc:  # not installed, or failed: reported, not fatal
        mds_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    warm(root)

    dataset = ShardedDataset(root / "shards")
    n, world, per_rank = len(dataset), args.world, args.per_rank_batch
    gbs = world * per_rank
    steps = args.epochs * (n // gbs)
    order = OrderSpec(n, seed=0, shard_sizes=dataset.shard_sizes)
    rank_ids = [np.concatenate(p.ids[0]) for p in plan_steps(order, 0, steps, gbs, world, 1)]
    samples_per_run = steps * per_rank
    raw_x = np.load(root / "x.npy", mmap_mode="r")
    raw_y = np.load(root / "y.npy", mmap_mode="r")
    shard_x = [
        np.load(root / "shards" / f"{s['name']}.x.npy", mmap_mode="r")
        for s in dataset.manifest["shards"]
    ]
    shard_y = [
        np.load(root / "shards" / f"{s['name']}.y.npy", mmap_mode="r")
        for s in dataset.manifest["shards"]
    ]
    starts = np.concatenate([[0], np.cumsum(dataset.shard_sizes)])

    def raw() -> int:
        for ids in rank_ids:
            batch = {"x": torch.from_numpy(raw_x[ids]), "y": torch.from_numpy(raw_y[ids])}
            assert batch["x"].shape[0] == len(ids)
        return samples_per_run

    def raw_shards() -> int:
        for ids in rank_ids:
            shard = np.searchsorted(starts, ids, side="right") - 1
            parts = [(s, ids[shard == s] - starts[s]) for s in np.unique(shard)]
            batch = {
                "x": torch.from_numpy(np.concatenate([shard_x[s][loc] for s, loc in parts])),
                "y": torch.from_numpy(np.concatenate([shard_y[s][loc] for s, loc in parts])),
            }
            assert batch["x"].shape[0] == len(ids)
        return samples_per_run

    small = ShardedDataset(root / "small-shards")
    small_order = OrderSpec(n, seed=0, shard_sizes=small.shard_sizes)
    # The same stream of ids: a full shuffle does not depend on the shard sizes.
    assert np.array_equal(plan_steps(small_order, 0, 1, gbs, world, 1)[0].ids[0][0], rank_ids[0])
    small_starts = np.concatenate([[0], np.cumsum(small.shard_sizes)])
    touched = statistics.mean(
        len(np.unique(small_starts.searchsorted(ids, "right"))) for ids in rank_ids
    )

    def dtrain_loader(
        prefetch: int, work: Callable[[], None] | None = None, source: ShardedDataset = dataset
    ) -> Callable[[], int]:
        source_order = OrderSpec(n, seed=0, shard_sizes=source.shard_sizes)

        def run() -> int:
            loader = RankLoader(
                source,
                order=source_order,
                global_batch_size=gbs,
                micro_batches=1,
                rank=0,
                world_size=world,
                collate_fn=default_collate,
                num_workers=args.workers,
                prefetch=prefetch,
                fingerprint=source.fingerprint,
            )
            for _, batch in zip(range(steps), loader):
                assert batch.micro[0]["x"].shape[0] == per_rank
                if work is not None:
                    work()
            loader.close()
            return samples_per_run

        return run

    rows = RawRows(root)

    def torch_dataloader() -> int:
        sampler = DistributedSampler(rows, num_replicas=world, rank=0, shuffle=True, seed=0)
        loader = DataLoader(
            rows, batch_size=per_rank, sampler=sampler, num_workers=args.workers, drop_last=True
        )
        done = 0
        while done < steps:  # DistributedSampler's epoch holds n // world samples
            for _, batch in zip(range(steps - done), loader):
                assert batch["x"].shape[0] == per_rank
                done += 1
        return samples_per_run

    raw_name, shards_name = (
        "raw NumPy: memmap[ids] of one .npy per field",
        "raw NumPy: the shard files",
    )
    sync_name = "dtrain RankLoader, synchronous (prefetch=0, the default on CPU)"
    many_name = f"dtrain RankLoader, synchronous, {len(small.shard_sizes)} shards of 1 MiB"
    thread_name = "dtrain RankLoader, prefetch thread (prefetch=2, the default on GPU)"
    if args.workers:
        sync_name = f"dtrain RankLoader, {args.workers} DataLoader workers"
        thread_name = ""
    methods: dict[str, Callable[[], int]] = {
        raw_name: raw,
        shards_name: raw_shards,
        sync_name: dtrain_loader(0),
        "torch DataLoader + DistributedSampler": torch_dataloader,
    }
    if not args.workers:
        methods[many_name] = dtrain_loader(0, source=small)
    if thread_name:
        methods[thread_name] = dtrain_loader(2)
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():  # one untimed pass each: imports, maps, shuffles
        fn()
    for _ in range(args.repeats):  # interleaved, so drift in the machine hits all alike
        for name, fn in methods.items():
            w, c = timed(fn)
            wall[name].append(w)
            cpu[name].append(c)
    overlap = (
        overlap_section(dtrain_loader, per_rank / statistics.median(wall[raw_name]), args.repeats)
        if not args.workers
        else []
    )
    # mosaicml-streaming last, once everything else is measured: with a StreamingDataset alive
    # in the process (its shared memory and threads), every other method here ran 3-10x slower
    # and erratically (medians far below the best runs), which would misstate all the ratios.
    if not mds_error:
        name = "mosaicml-streaming StreamingDataset (one process)"
        try:
            StreamingDataset = import_streaming().StreamingDataset
            streaming = StreamingDataset(
                local=str(mds), shuffle=True, shuffle_seed=0, batch_size=per_rank
            )

            def mosaic() -> int:
                loader = DataLoader(
                    streaming, batch_size=per_rank, num_workers=args.workers, drop_last=True
                )
                done = 0
                while done < steps:
                    for _, batch in zip(range(steps - done), loader):
                        assert batch["x"].shape[0] == per_rank
                        done += 1
                return samples_per_run

            mosaic()  # untimed, as the others
            methods[name], wall[name], cpu[name] = mosaic, [], []
            for _ in range(3):  # two orders of magnitude slower: three runs say enough
                w, c = timed(mosaic)
                wall[name].append(w)
                cpu[name].append(c)
        except Exception:
            mds_error = traceback.format_exc().strip().splitlines()[-1]
            for table in (methods, wall, cpu):
                table.pop(name, None)
    med_wall = {name: statistics.median(v) for name, v in wall.items()}
    med_cpu = {name: statistics.median(v) for name, v in cpu.items()}
    mb = args.sample_bytes / 1e6
    load = os.getloadavg()[0]
    lines = [
        "## Loader throughput per rank (`bench_loader.py`)",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}; load average {load:.1f} when it finished  ",
        f"Data: {n:,} samples of {args.sample_bytes} B (uint8) + an int64 label, "
        f"{n * args.sample_bytes / 1e6:.0f} MB in {len(dataset.shard_sizes)} shards, and again "
        f"in {len(small.shard_sizes)} shards of 1 MiB (where a step's {per_rank} samples lie in "
        f"{touched:.0f} different shards on average), and as one .npy per field for the raw "
        "baseline; "
        f"rank 0 of {world}, {per_rank} "
        f"samples per step, {steps} steps per run ({args.epochs} epochs of the rank), "
        f"num_workers={args.workers}, warm page cache. Median of {args.repeats} interleaved "
        "runs, by wall-clock time and by this process's CPU time (all threads).",
        "",
        "| method | samples/s, wall (median) | MB/s, wall | samples/s, wall (best) | "
        "samples/s, CPU (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    best_wall = {name: max(v) for name, v in wall.items()}
    for name in methods:
        lines.append(
            f"| {name} | {med_wall[name]:,.0f} | {med_wall[name] * mb:,.0f} | "
            f"{best_wall[name]:,.0f} | {med_cpu[name]:,.0f} |"
        )
    if mds_error:
        lines += ["", f"mosaicml-streaming: not measured ({mds_error})."]
    else:
        lines += [
            "",
            f"mosaicml-streaming {import_streaming().__version__} from a separate virtual "
            "environment (`pip install torch==2.13.0 -e '.[bench]'`), which is also the "
            "Python that ran this whole table.",
        ]
    if not mds_error and STUBBED:
        lines += [
            "",
            "mosaicml-streaming: `import streaming` loads its vision helpers, which import "
            "torchvision; PyPI's torchvision is a CUDA build that cannot load beside the CPU "
            "torch here, so the script gave `streaming` a stand-in for the two torchvision "
            "names it imports (unused by `StreamingDataset` and the MDS reader measured).",
        ]
    lines += [
        "",
        "Ratios (dtrain / baseline) of the medians, by wall-clock and by CPU time, and of the "
        "best wall-clock runs:",
        "",
    ]
    targets = {raw_name: 0.9, shards_name: 0.9, "torch DataLoader + DistributedSampler": 1.0}
    ours = [name for name in methods if name.startswith("dtrain")]
    for base in [b for b in methods if not b.startswith("dtrain")]:
        for mine in ours:
            w = med_wall[mine] / med_wall[base]
            c = med_cpu[mine] / med_cpu[base]
            b = best_wall[mine] / best_wall[base]
            target = targets.get(base)
            verdict = ""
            if target is not None and not args.workers:
                verdict = f" (target {target}x: wall {'met' if w >= target else 'MISSED'}, CPU "
                verdict += f"{'met' if c >= target else 'MISSED'})"
            elif target is not None:
                verdict = f" (target {target}x: {'met' if w >= target else 'MISSED'})"
            lines.append(
                f"- {mine} / {base}: {w:.2f}x wall, {c:.2f}x CPU, {b:.2f}x best wall{verdict}"
            )
    lines += overlap
    lines.append(f"- measured {time.strftime('%Y-%m-%d')}")
    text = "\n".join(lines)
    print(text)
    if not args.no_doc:
        print(f"\nwrote {update_section('bench_loader', text)}")


if __name__ == "__main__":
    main()
