"""Loader from shards in an object store against the same shards local, the ranks of one machine,
with the store behind a rate-limited link.

An S3 server (moto's) runs in a network namespace of its own (``dts3b-srv``, 10.231.0.2), joined
to this one by a veth pair (``dts3b-a`` here, 10.231.0.1); ``tc tbf`` limits both ends to each
rate in turn. ``--world`` ranks, each a process of this machine, take ``--steps`` steps of their
loader, each followed by ``--step-ms`` of simulated compute: the machine's consumption is a
global batch per step. Local shards and the store's are timed side by side at each rate (the
store's ranks share the machine's cache of pieces, ``--cache-mb``); the ratio is the store's
steps/s over the local's, of the slowest rank, from its first step (which waits for whatever of
the first window's pieces are not there yet, as a run's does), from the loader's construction
(the dataset opened and ``--setup-ms`` of the job's set-up, the same for both: the model, the
process group and the optimizer, during which the loader reads its first window ahead, as the
trainer's does once the position is known) and after the first step (steady). Beside it, the
cold ratio: the read-ahead started by the first step (the loader before #42's warm start). It
holds near 1 while the link carries more than the consumption, then falls with the link (the
printed consumption says where). The first ``--detail`` steps' waits and the dataset's opening
by phase (the manifest's read: the client's first requests; the listing; the offsets files)
show where a start's time goes.

Per rate it prints the bytes each rank fetched and the machine's (every piece once, when the
ranks share the cache; before the first step: the warm read-ahead's), the requests, the SHA-256
time, each rank's CPU beside the local run's and the S3 server's CPU (it shares the machine's
cores).

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

    elapsed: float  # from the loader's construction to the end of its last step
    steps: float  # from its first step to the end of its last
    waits: list[float]  # each step's wait for its batch
    opening: dict[str, float]  # the dataset's opening, by phase (a store's only)
    fetched: int = 0
    early: int = 0  # bytes fetched before its first step asked (the warm read-ahead's)
    requests: int = 0
    hash_s: float = 0.0
    cpu_s: float = 0.0


def timed_phases(phases: dict[str, float]) -> None:
    """Time the phases of opening a dataset in a store, in this process (a rank's): the
    manifest's read (the client's first requests: its credentials, its connection), the
    listing that checks every file, the machine's cache joined."""
    import dtrain.data.shards as shards
    from dtrain.data import store_shards

    def timed(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - began

        return run

    shards.read_manifest = timed("manifest", shards.read_manifest)  # type: ignore[assignment]
    cls = store_shards.StoreShards
    cls._check_objects = timed("listing", cls._check_objects)  # type: ignore[method-assign]
    store_shards.NodeCache = timed("cache join", store_shards.NodeCache)  # type: ignore[misc]


def run_rank(
    rank: int,
    url: str,
    args: argparse.Namespace,
    start: Any,
    out: Any,
    cache_dir: str,
    warm: bool,
) -> None:
    """A rank's loader (a process of its own, as in a job) from the moment every rank is
    ready: the dataset opened, the loader built (``warm``: its read-ahead started, as the
    trainer does once the position is known), ``setup_ms`` of the job's set-up (the model,
    the process group, the optimizer: the same for local and the store), then its steps, each
    followed by ``step_ms`` of compute."""
    from torch.utils.data import default_collate

    torch.set_num_threads(1)
    opening: dict[str, float] = {}
    timed_phases(opening)
    start.wait()
    cpu = time.process_time()
    began = time.perf_counter()
    dataset = ShardedDataset(url, cache_dir, args.cache_mb * 2**20)
    order = OrderSpec(len(dataset), 0, "locality", dataset.shard_sizes)
    ahead = None
    if dataset.store is not None:
        dataset.store.sharers = args.world  # the ranks of this machine share its cache
        ahead = ReadAhead(dataset.store, dataset.pieces, rank)
        offsets = time.perf_counter()
        dataset.pieces([0])  # the offsets files, read whole when a run opens the dataset
        opening["offsets files"] = time.perf_counter() - offsets
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
    opening["opened"] = time.perf_counter() - began
    if warm:
        loader.warm()
    time.sleep(args.setup_ms / 1000)
    early = dataset.store.fetched if dataset.store is not None else 0
    first_step = time.perf_counter()
    waits = []
    for _ in range(args.steps):
        asked = time.perf_counter()
        next(loader)
        waits.append(time.perf_counter() - asked)
        time.sleep(args.step_ms / 1000)
    end = time.perf_counter()
    run = RankRun(end - began, end - first_step, waits, opening, early=early)
    run.cpu_s = time.process_time() - cpu
    loader.close()
    if dataset.store is not None:
        store = dataset.store
        run.fetched, run.requests, run.hash_s = store.fetched, store.requests, store.hash_seconds
    out.put((rank, run))


def run_machine(
    url: str, args: argparse.Namespace, cache_dir: str, warm: bool = True
) -> list[RankRun]:
    """Every rank of the machine at once, each a process; their runs in rank order."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(args.world), ctx.Queue()
    procs = [
        ctx.Process(target=run_rank, args=(r, url, args, start, out, cache_dir, warm))
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


def rate_of(runs: list[RankRun], steps: int) -> tuple[float, float, float]:
    """Steps/s of the slowest rank: from the loader's construction (the job's set-up in it),
    from its first step, and after its first step's wait (steady)."""
    return (
        min(steps / r.elapsed for r in runs),
        min(steps / r.steps for r in runs),
        min((steps - 1) / (r.steps - r.waits[0]) for r in runs),
    )


def first_waits(runs: list[RankRun], n: int) -> str:
    """The first ``n`` steps' waits for their batch, ms, of the slowest rank at each."""
    return " ".join(f"{max(r.waits[i] for r in runs) * 1e3:.0f}" for i in range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1000,300,200,100", help="link rates, mbit/s")
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--sample-bytes", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--world", type=int, default=2, help="ranks, all on this machine")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated compute a step")
    parser.add_argument(
        "--setup-ms",
        type=float,
        default=500.0,
        help="the job's set-up between the loader's construction and its first step (the "
        "model, the process group, the optimizer): the same for local and the store",
    )
    parser.add_argument("--detail", type=int, default=10, help="first steps' waits shown")
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
    detail = min(args.detail, args.steps)
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
                f"Timed from the first step (the run a user sees once training starts), and "
                f"from the loader's construction: the dataset opened, then {args.setup_ms:g} ms "
                "of the job's set-up (model, process group, optimizer; the same for local "
                "and S3) during which the warm loader reads its first window ahead; cold: the "
                "read-ahead starts at the first step (before #42's warm start)",
                f"{'link':>10} {'local steps/s':>14} {'S3 steps/s':>11} {'ratio':>6} "
                f"{'from constr.':>13} {'steady':>7} {'1st step ms':>12} {'cold ratio':>11} "
                f"{'cold 1st ms':>12}",
            ]
            costs = [
                f"{'link':>10} {'fetched MiB per rank':>21} {'machine':>8} {'before 1st':>11} "
                f"{'requests':>9} "
                f"{'sha256 s':>9} {'rank CPU s (local)':>19} {'server CPU s':>13}"
            ]
            firsts = [
                f"The first {detail} steps' waits for their batch, ms (slowest rank), and "
                "the opening of the dataset in the store, ms (slowest rank)",
            ]
            print("\n".join(lines))
            for rate in (int(r) for r in args.rates.split(",")):
                shape(rate)
                base = run_machine(str(local), args, "")
                cold = run_machine(f"s3://{BUCKET}/data", args, str(Path(scratch) / "c"), False)
                server_cpu = cpu_seconds(server.pid)
                runs = run_machine(f"s3://{BUCKET}/data", args, str(Path(scratch) / f"w{rate}"))
                server_cpu = cpu_seconds(server.pid) - server_cpu
                local_from, local_rate, local_steady = rate_of(base, args.steps)
                warm_from, warm_rate, warm_steady = rate_of(runs, args.steps)
                cold_rate = rate_of(cold, args.steps)[1]
                line = (
                    f"{rate:>6} Mbit {local_rate:>14.1f} {warm_rate:>11.1f} "
                    f"{warm_rate / local_rate:>6.2f} {warm_from / local_from:>13.2f} "
                    f"{warm_steady / local_steady:>7.2f} "
                    f"{max(r.waits[0] for r in runs) * 1e3:>6.0f} "
                    f"({max(r.waits[0] for r in base) * 1e3:.0f}) "
                    f"{cold_rate / local_rate:>11.2f} {max(r.waits[0] for r in cold) * 1e3:>12.0f}"
                )
                print(line, flush=True)
                lines.append(line)
                opening = {
                    name: max(r.opening.get(name, 0.0) for r in runs) * 1e3
                    for name in runs[0].opening
                }
                firsts += [
                    f"{rate:>6} Mbit local: {first_waits(base, detail)}",
                    f"{'':>11} S3 cold: {first_waits(cold, detail)}",
                    f"{'':>11} S3 warm: {first_waits(runs, detail)}",
                    f"{'':>11} opening: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in opening.items())
                    + f" (local opened in {max(r.opening['opened'] for r in base) * 1e3:.0f})",
                ]
                per_rank = "/".join(f"{r.fetched / 2**20:.0f}" for r in runs)
                cpu = "/".join(f"{r.cpu_s:.2f}" for r in runs)
                cpu_local = "/".join(f"{r.cpu_s:.2f}" for r in base)
                costs.append(
                    f"{rate:>6} Mbit {per_rank:>21} "
                    f"{sum(r.fetched for r in runs) / 2**20:>8.0f} "
                    f"{sum(r.early for r in runs) / 2**20:>11.1f} "
                    f"{sum(r.requests for r in runs):>9} {sum(r.hash_s for r in runs):>9.2f} "
                    f"{cpu + ' (' + cpu_local + ')':>19} {server_cpu:>13.2f}"
                )
            print("\n".join(firsts))
            print("\n".join(costs))
            lines += ["", *firsts, "", *costs]
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
