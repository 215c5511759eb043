"""What making a gloo process group costs the job's store: calls and bytes of
``init_process_group`` and of a second group (the checkpointer's), and of the first collectives
on both, at W = 2, 4, 8 processes on this machine, with gloo's eager full mesh and with
``TORCH_GLOO_LAZY_INIT=1`` side by side.

    PYTHONPATH=src python benchmarks/group_mesh.py --world 2 4 8

Each rank's store is a counting wrapper around its TCPStore client (a ``dist.Store`` written
in Python, which torch's gloo rendezvous calls like any other); the sums over the ranks are
printed, one line per (mode, W). Figures: docs/fault-tolerance.md, "Process groups".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Counting(dist.Store):  # type: ignore[misc]
    """A store that counts the calls made on it and the bytes of keys and values moved."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.calls, self.bytes = inner, 0, 0

    def _count(self, moved: int = 0) -> None:
        self.calls += 1
        self.bytes += moved

    def set(self, key: str, value: bytes) -> None:
        self._count(len(key) + len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count(len(key) + len(value))
        return bytes(value)

    def add(self, key: str, amount: int) -> int:
        self._count(len(key))
        return int(self.inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        self._count()
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], *timeout: Any) -> None:
        self._count()
        self.inner.wait(keys, *timeout)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._count(len(key) + len(desired))
        return bytes(self.inner.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        self._count()
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)


def rank_main(rank: int, world: int, port: int, results: Any) -> None:
    timeout = datetime.timedelta(seconds=120)
    client = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, world, rank == 0, timeout=timeout, wait_for_workers=False
    )
    store = Counting(client)
    started = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store, timeout=timeout)
    made = (store.calls, store.bytes, time.perf_counter() - started)
    group = dist.new_group(backend="gloo")
    second = (store.calls - made[0], store.bytes - made[1])
    ones = torch.ones(4)
    dist.all_reduce(ones)
    dist.all_reduce(ones, group=group)
    dist.barrier()
    used = (store.calls - made[0] - second[0], store.bytes - made[1] - second[1])
    results.put((rank, made, second, used, float(ones[0])))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, lazy: bool) -> dict[str, Any]:
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if lazy else "0"  # inherited by the ranks
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=rank_main, args=(r, world, port, results)) for r in range(world)
    ]
    for process in ranks:
        process.start()
    out = [results.get(timeout=300) for _ in ranks]
    for process in ranks:
        process.join()
    assert all(each[4] == world * world for each in out), out  # both sums right
    return {
        "mode": "lazy" if lazy else "eager",
        "world": world,
        "group_calls": sum(each[1][0] for each in out),
        "group_bytes": sum(each[1][1] for each in out),
        "second_group_calls": sum(each[2][0] for each in out),
        "second_group_bytes": sum(each[2][1] for each in out),
        "first_collectives_calls": sum(each[3][0] for each in out),
        "first_collectives_bytes": sum(each[3][1] for each in out),
        "init_s": round(max(each[1][2] for each in out), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    for lazy in (False, True):
        for world in args.world:
            print(json.dumps(measure(world, lazy)), flush=True)


if __name__ == "__main__":
    main()
