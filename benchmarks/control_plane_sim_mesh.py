"""Two parts of ``benchmarks/control_plane_sim.py`` beside the simulated ranks: gloo's full
mesh at a process group's creation, counted on the real store, and the real 8-rank job the
simulation checks itself against (``benchmarks/control_plane.py``'s job)."""

from __future__ import annotations

import datetime
import json
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch.distributed as dist


class CountingStore(dist.Store):  # type: ignore[misc]
    """A store that counts the calls and bytes a process group's creation makes of it, and
    passes each to the real client (a Python store: gloo takes any ``dist.Store``)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.calls, self.bytes = inner, Counter[str](), 0

    def set(self, key: str, value: Any) -> None:
        self.calls["set"] += 1
        self.bytes += len(key) + len(value)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.calls["get"] += 1
        value = self.inner.get(key)
        self.bytes += len(key) + len(value)
        return bytes(value)

    def add(self, key: str, n: int) -> int:
        self.calls["add"] += 1
        self.bytes += len(key) + 8
        return int(self.inner.add(key, n))

    def check(self, keys: list[str]) -> bool:
        self.calls["check"] += 1
        self.bytes += sum(map(len, keys))
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.calls["wait"] += 1
        self.bytes += sum(map(len, keys))
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.calls["compare_set"] += 1
        self.bytes += len(key) + len(expected) + len(desired)
        return bytes(self.inner.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        self.calls["delete_key"] += 1
        return bool(self.inner.delete_key(key))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)


def mesh(port: int, world: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """One gloo group of ``world`` ranks (threads of this process), made as dtrain makes its
    groups (gloo on loopback, the store under a prefix): its store calls and bytes in all, and
    the wall time until every rank has it; then one all-reduce, checked."""
    import torch

    from dtrain.dist.stores import client_store

    stores = [
        CountingStore(dist.PrefixStore("pg", client_store("127.0.0.1", port, timeout_s)))  # type: ignore[attr-defined]
        for _ in range(world)
    ]
    device = dist.ProcessGroupGloo.create_device(interface="lo")  # type: ignore[attr-defined]
    groups: list[Any] = [None] * world

    failures: list[str] = []

    def make(rank: int) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [device]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        try:
            groups[rank] = dist.ProcessGroupGloo(stores[rank], rank, world, options)  # type: ignore[attr-defined]
        except RuntimeError as exc:  # gloo's connect timed out: said, not raised
            failures.append(str(exc).splitlines()[0][:200])

    started = time.perf_counter()
    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    made_s = time.perf_counter() - started
    if failures:
        return {"world": world, "error": f"{len(failures)} of {world} ranks: {failures[0]}"}
    ones = [torch.ones(1) for _ in range(world)]
    for work in [g.allreduce([t]) for g, t in zip(groups, ones, strict=True)]:
        work.wait()
    assert all(float(t) == world for t in ones), "the group's all-reduce is wrong"
    return {
        "world": world,
        "calls": sum(sum(s.calls.values()) for s in stores),
        "bytes": sum(s.bytes for s in stores),
        "made_s": made_s,
    }


def real_job(world: int, steps: int, sleep_ms: float) -> dict[str, Any]:
    """A real ``world``-rank job of ``benchmarks/control_plane.py`` (the one-machine steady
    run): per-rank store calls per second (``StoreLink.call``, its instruments' count; the
    median rank) and the CPU share of rank 0's store thread between step 20 and the end."""
    import control_plane as real
    from control_plane_sim import cpu_s, store_thread

    with tempfile.TemporaryDirectory(prefix="dtrain-cpsim-real-") as tmp:
        run_dir = Path(tmp) / "run"
        config = real.write_config(Path(tmp) / "job.toml", run_dir, world, steps, sleep_ms)
        launches = real.start(real.Layout(1, world), config)
        launch = launches[0]
        try:
            real.wait_for(run_dir, launches, lambda r: r.get("kind") == "train", 1200)
            pid = next(p for p in launch.workers() if real.rank_of(p) == 0)
            tid = store_thread(pid)
            first = real.wait_for(
                run_dir, launches, lambda r: r.get("kind") == "train" and r["step"] >= 20, 1200
            )
            mark = (time.time(), cpu_s(pid, tid))
            last = real.wait_for(
                run_dir,
                launches,
                lambda r: r.get("kind") == "train" and r["step"] >= steps - 10,
                1200,
            )
            end = (time.time(), cpu_s(pid, tid))
            code = launch.wait(1200)
        finally:
            real.close(launches)
        if code != 0:
            raise RuntimeError(f"the real {world}-rank job failed: {real.outputs(launches)}")
        ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "bench").glob("*.json"))]
        per_rank = [real.measured(r) for r in ranks]
        return {
            "calls": statistics.median(p["per_s"]["store_calls"] for p in per_rank),
            "store_thread": (end[1] - mark[1]) / (end[0] - mark[0]),
            "step_s": (last["time"] - first["time"]) / max(1, last["step"] - first["step"]),
            "window_s": end[0] - mark[0],
            "store_thread_found": tid is not None,
        }
