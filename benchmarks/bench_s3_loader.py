"""Loader from shards in an object store against the same shards local, per rank, with the store
behind a rate-limited link.

An S3 server (moto's) runs in a network namespace of its own (``dts3b-srv``, 10.231.0.2), joined
to this one by a veth pair (``dts3b-a`` here, 10.231.0.1); ``tc tbf`` limits both ends to each
rate in turn. One rank's loader (rank 0 of ``--world``) takes ``--steps`` steps, each followed by
``--step-ms`` of simulated compute: the training's consumption is the rank's share of a batch
per step. Local shards and the store's are timed side by side at each rate; the ratio is the
store's steps/s over the local's, and it holds near 1 while the link carries more than the
consumption, then falls with the link (the printed consumption says where).

The shuffle is ``locality`` (a window of shards at a time): a rank's pieces of 1 MiB are then
each read once per epoch; under a full shuffle over data far larger than the cache, each sample
reads a piece of its own (docs/data.md).

Needs root (namespaces, veth, tc); every exit path removes the namespace and the veth.

    sudo python benchmarks/bench_s3_loader.py                     # rates 1000, 100, 20 mbit
    sudo python benchmarks/bench_s3_loader.py --rates 100 --steps 20 --samples 4096 --no-doc
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

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


def run_loader(dataset: ShardedDataset, args: argparse.Namespace) -> float:
    """Steps per second of rank 0 of ``args.world``, each step then ``step_ms`` of compute."""
    from torch.utils.data import default_collate

    order = OrderSpec(len(dataset), 0, "locality", dataset.shard_sizes)
    ahead = None
    if dataset.store is not None:
        dataset.store.limit = args.cache_mb * 2**20
        ahead = ReadAhead(dataset.store, dataset.pieces, 0)
    loader = RankLoader(
        dataset,
        order=order,
        global_batch_size=args.batch * args.world,
        micro_batches=1,
        rank=0,
        world_size=args.world,
        collate_fn=default_collate,
        prefetch=2,
        ahead=ahead,
    )
    # From the first step on: the first waits for the first window's pieces, as a run does.
    start = time.perf_counter()
    for _ in range(args.steps):
        next(loader)
        time.sleep(args.step_ms / 1000)
    elapsed = time.perf_counter() - start
    loader.close()
    return args.steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1000,100,20", help="link rates, mbit/s")
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--sample-bytes", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated compute a step")
    parser.add_argument("--cache-mb", type=int, default=64)
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
            consumption = args.batch * (args.sample_bytes + 8) * 8 / (args.step_ms / 1000) / 1e6
            # A piece holds the rows of every rank: under the locality shuffle each rank reads
            # the whole window, world times its own share.
            lines = [
                f"rank 0 of {args.world}: {args.batch} samples of {args.sample_bytes} B a step, "
                f"{args.step_ms:g} ms of compute a step: its share is {consumption:.0f} Mbit/s "
                f"at full speed, the pieces it reads {consumption * args.world:.0f} Mbit/s; "
                f"{args.steps} steps, {consumption * args.steps * args.step_ms / 8e3:.0f} MB "
                "of its own",
                f"{'link':>10} {'local steps/s':>14} {'S3 steps/s':>11} {'ratio':>6} "
                f"{'fetched MiB':>11}",
            ]
            print(lines[0])
            print(lines[1])
            for rate in (int(r) for r in args.rates.split(",")):
                shape(rate)
                local_rate = run_loader(ShardedDataset(local), args)
                remote = ShardedDataset(f"s3://{BUCKET}/data", cache_bytes=args.cache_mb * 2**20)
                store_rate = run_loader(remote, args)
                assert remote.store is not None
                line = (
                    f"{rate:>6} Mbit {local_rate:>14.1f} {store_rate:>11.1f} "
                    f"{store_rate / local_rate:>6.2f} {remote.store.fetched / 2**20:>11.0f}"
                )
                print(line, flush=True)
                lines.append(line)
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
