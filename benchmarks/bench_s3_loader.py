"""Loader from shards in an object store against the same shards local, the ranks of one machine,
with the store behind a rate-limited link.

An S3 server (moto's) runs in a network namespace of its own (``dts3b-srv``, 10.231.0.2), joined
to this one by a veth pair (``dts3b-a`` here, 10.231.0.1); ``tc tbf`` limits both ends to each
rate in turn. ``--world`` ranks, each a process of this machine, take ``--steps`` steps of their
loader, each followed by ``--step-ms`` of simulated compute: the machine's consumption is a
global batch per step. Local shards and the store's are timed side by side at each rate (the
store's ranks share the machine's cache of pieces, ``--cache-mb``); the ratio is the store's
steps/s over the local's, of the slowest rank, from its first step (which waits for the first
window's pieces, as a run's does) and, apart, after it (steady). It holds near 1 while the link
carries more than the consumption, then falls with the link (the printed consumption says
where).

Per rate it prints the bytes each rank fetched and the machine's (every piece once, when the
ranks share the cache), the requests, the SHA-256 time, each rank's CPU beside the local run's
and the S3 server's CPU (it shares the machine's cores).

The shuffle is ``locality`` (a window of shards at a time): the machine's pieces of 1 MiB are
then each read once per epoch; under a full shuffle over data far larger than the cache, each
sample reads a piece of its own (docs/data.md).

Needs root (namespaces, veth, tc); every exit path removes the namespace and the veth.

    sudo python benchmarks/bench_s3_loader.py                  # rates 1000, 300, 200, 100 mbit
    sudo python benchmarks/bench_s3_loader.py --rates 100 --steps 20 --samples 4096 --no-doc
"""

from __future__ import annotations

import argparse
import atexit
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command_line, machine_line, update_section
from dtrain.data.loader import RankLoader
from dtrain.data.partition import OrderSpec
from dtrain.data.read_ahead import ReadAhead
from dtrain.data.shards import ShardedDataset, ShardWriter
from dtrain.data.upload import upload_dataset
from dtrain.storage.objects import ObjectPath

NS, HOST_DEV, NS_DEV = "dts3b-srv", "dts3b-a", "dts3b-b"
HOST_IP, NS_IP, PORT = "10.231.0.1", "10.231.0.2", 5000
KEY, SECRET, BUCKET = "bench", "bench-secret", "bench"


def sh(*args: str, check: bool = True) -> None:
    subprocess.run(args, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def teardown() -> None:
    """Remove what :func:`setup` made; safe to run twice (deleting the veth deletes its peer)."""
    sh("ip", "link", "del", HOST_DEV, check=False)
    sh("ip", "netns", "del", NS, check=False)


def setup() -> None:
    teardown()
    sh("ip", "netns", "add", NS)
    sh("ip", "link", "add", HOST_DEV, "type", "veth", "peer", "name", NS_DEV)
    sh("ip", "link", "set", NS_DEV, "netns", NS)
    sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_DEV)
    sh("ip", "link", "set", HOST_DEV, "up")
    sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/24", "dev", NS_DEV)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_DEV, "up")
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")


def shape(mbit: int | None) -> None:
    """Both ends of the link at ``mbit`` (None: unlimited)."""
    for prefix in ([], ["ip", "netns", "exec", NS]):
        dev = NS_DEV if prefix else HOST_DEV
        sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if mbit is not None:
            burst = max(65536, mbit * 125_000 // 100)  # 10 ms at the rate, one 64 KiB segment
            sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
               "burst", str(burst), "latency", "50ms")  # fmt: skip


def start_server() -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            NS,
            sys.executable,
            "-m",
            "moto.server",
            "-H",
            NS_IP,
            "-p",
            str(PORT),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import s3fs

    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, endpoint_url=f"http://{NS_IP}:{PORT}")
    for _ in range(200):  # the server takes a few seconds to import
        try:
            fs.ls("")
            break
        except Exception:
            time.sleep(0.1)
    fs.mkdir(BUCKET)
    return server


def build(root: Path, samples: int, sample_bytes: int) -> Path:
    rng = np.random.default_rng(0)
    with ShardWriter(root / "local", shard_bytes=4 * 2**20) as writer:
        for begin in range(0, samples, 4096):
            end = min(samples, begin + 4096)
            x = rng.integers(0, 256, (end - begin, sample_bytes), dtype=np.uint8)
            writer.write_rows({"x": x, "y": np.arange(begin, end, dtype=np.int64)})
    return root / "local"


@dataclass
class RankRun:
    """One rank's run: its times (seconds) and what it cost."""

    elapsed: float
    first: float  # its first step's wait
    fetched: int = 0
    requests: int = 0
    hash_s: float = 0.0
    cpu_s: float = 0.0


def run_rank(
    rank: int, url: str, args: argparse.Namespace, start: Any, out: Any, cache_dir: str
) -> None:
    """A rank's loader (a process of its own, as in a job): its steps, each then ``step_ms``
    of compute, from the moment every rank is ready."""
    from torch.utils.data import default_collate

    torch.set_num_threads(1)
    dataset = ShardedDataset(url, cache_dir, args.cache_mb * 2**20)
    order = OrderSpec(len(dataset), 0, "locality", dataset.shard_sizes)
    ahead = None
    if dataset.store is not None:
        dataset.store.sharers = args.world  # the ranks of this machine share its cache
        ahead = ReadAhead(dataset.store, dataset.pieces, rank)
        dataset.pieces([0])  # the offsets files, read whole when a run opens the dataset
    loader = RankLoader(
        dataset,
        order=order,
        global_batch_size=args.batch * args.world,
        micro_batches=1,
        rank=rank,
        world_size=args.world,
        collate_fn=default_collate,
        prefetch=2,
        ahead=ahead,
    )
    start.wait()
    cpu = time.process_time()
    began = time.perf_counter()
    next(loader)  # the first waits for the first window's pieces, as a run's does
    first = time.perf_counter() - began
    time.sleep(args.step_ms / 1000)
    for _ in range(args.steps - 1):
        next(loader)
        time.sleep(args.step_ms / 1000)
    run = RankRun(time.perf_counter() - began, first, cpu_s=time.process_time() - cpu)
    loader.close()
    if dataset.store is not None:
        store = dataset.store
        run.fetched, run.requests, run.hash_s = store.fetched, store.requests, store.hash_seconds
    out.put((rank, run))


def run_machine(url: str, args: argparse.Namespace, cache_dir: str) -> list[RankRun]:
    """Every rank of the machine at once, each a process; their runs in rank order."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(args.world), ctx.Queue()
    procs = [
        ctx.Process(target=run_rank, args=(r, url, args, start, out, cache_dir))
        for r in range(args.world)
    ]
    for proc in procs:
        proc.start()
    runs = dict(out.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            sys.exit(f"bench_s3_loader: a rank exited with {proc.exitcode}")
    return [runs[r] for r in range(args.world)]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rate_of(runs: list[RankRun], steps: int) -> tuple[float, float]:
    """Steps/s of the slowest rank: from its first step, and after it (steady)."""
    return (
        min(steps / r.elapsed for r in runs),
        min((steps - 1) / (r.elapsed - r.first) for r in runs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1000,300,200,100", help="link rates, mbit/s")
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--sample-bytes", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--world", type=int, default=2, help="ranks, all on this machine")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated compute a step")
    parser.add_argument("--cache-mb", type=int, default=128, help="the machine's cache")
    parser.add_argument("--no-doc", action="store_true", help="print only")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_s3_loader: needs root (a network namespace, a veth pair, tc)")
    atexit.register(teardown)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: sys.exit(1))  # atexit then tears down
    setup()
    server = start_server()
    os.environ.update(
        AWS_ENDPOINT_URL_S3=f"http://{NS_IP}:{PORT}",
        AWS_ACCESS_KEY_ID=KEY,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-s3-") as scratch:
            local = build(Path(scratch), args.samples, args.sample_bytes)
            upload_dataset(local, ObjectPath(f"s3://{BUCKET}/data"))
            share = args.batch * (args.sample_bytes + 8) * 8 / (args.step_ms / 1000) / 1e6
            lines = [
                f"{args.world} ranks on one machine, each {args.batch} samples of "
                f"{args.sample_bytes} B a step and {args.step_ms:g} ms of compute a step: the "
                f"machine consumes {share * args.world:.0f} Mbit/s at full speed (a rank "
                f"{share:.0f}); {args.steps} steps, "
                f"{share * args.world * args.steps * args.step_ms / 8e3:.0f} MB of samples; "
                f"the machine's cache {args.cache_mb} MiB",
                f"{'link':>10} {'local steps/s':>14} {'S3 steps/s':>11} {'ratio':>6} "
                f"{'steady':>7} {'1st step ms':>12}",
            ]
            costs = [
                f"{'link':>10} {'fetched MiB per rank':>21} {'machine':>8} {'requests':>9} "
                f"{'sha256 s':>9} {'rank CPU s (local)':>19} {'server CPU s':>13}"
            ]
            print(lines[0])
            print(lines[1])
            for rate in (int(r) for r in args.rates.split(",")):
                shape(rate)
                base = run_machine(str(local), args, "")
                cache_dir = str(Path(scratch) / f"cache-{rate}")
                server_cpu = cpu_seconds(server.pid)
                runs = run_machine(f"s3://{BUCKET}/data", args, cache_dir)
                server_cpu = cpu_seconds(server.pid) - server_cpu
                (local_rate, local_steady), (rate_s3, steady_s3) = (
                    rate_of(base, args.steps),
                    rate_of(runs, args.steps),
                )
                first = max(r.first for r in runs) * 1e3
                first_local = max(r.first for r in base) * 1e3
                line = (
                    f"{rate:>6} Mbit {local_rate:>14.1f} {rate_s3:>11.1f} "
                    f"{rate_s3 / local_rate:>6.2f} {steady_s3 / local_steady:>7.2f} "
                    f"{first:>6.0f} ({first_local:.0f})"
                )
                print(line, flush=True)
                lines.append(line)
                per_rank = "/".join(f"{r.fetched / 2**20:.0f}" for r in runs)
                cpu = "/".join(f"{r.cpu_s:.2f}" for r in runs)
                cpu_local = "/".join(f"{r.cpu_s:.2f}" for r in base)
                costs.append(
                    f"{rate:>6} Mbit {per_rank:>21} "
                    f"{sum(r.fetched for r in runs) / 2**20:>8.0f} "
                    f"{sum(r.requests for r in runs):>9} {sum(r.hash_s for r in runs):>9.2f} "
                    f"{cpu + ' (' + cpu_local + ')':>19} {server_cpu:>13.2f}"
                )
            print("\n".join(costs))
            lines += ["", *costs]
    finally:
        server.terminate()
        server.wait()
        teardown()
    if not args.no_doc:
        body = "\n".join(
            [
                "## Loader from shards in S3 vs local, behind a rate-limited link",
                "",
                f"`{command_line()}`, {time.strftime('%Y-%m-%d')}; {machine_line()}",
                "",
                "```",
                *lines,
                "```",
            ]
        )
        update_section("bench_s3_loader", body)


if __name__ == "__main__":
    main()
