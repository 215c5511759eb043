"""Run a function on N real ranks (processes, gloo on loopback) -- for tests and benchmarks.

:func:`run_ranks` starts ``world_size`` processes with the environment torch's launcher would
set (RANK, WORLD_SIZE, MASTER_ADDR/PORT on a free loopback port, ...), joins them into a gloo
process group, calls ``fn(*args)`` in each and returns the per-rank results in rank order. An
exception in any rank fails the call with *that rank's* traceback; every process is ended before
it returns (on success, error or timeout), so no process outlives the call.

Processes come from a forkserver that has already imported torch, so each rank starts in a
fraction of a second instead of re-importing torch. It has imported torch._dynamo too, which
torch's DistributedDataParallel imports when it wraps a model: about 2 CPU-seconds per rank
otherwise -- most of what building a DDP trainer costs -- and, on a loaded machine, long enough
for the other ranks' first collective to time out waiting for it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

_CONTEXT: Any = None
# What the forkserver imports once, so that no rank it starts imports it again.
PRELOADED = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "numpy",
    "dtrain",
    "dtrain.train.trainer",
]


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOADED)
    return _CONTEXT


class RankFailed(AssertionError):
    """A rank raised, crashed or did not finish in time; the message holds its traceback."""


def loopback_store(timeout_s: float) -> tuple[Any, int]:
    """A job key-value store hosted here on a free loopback port, as rank 0 of a job hosts
    it: ``(store, port)``. Through dtrain's ``host_store``, which listens on 127.0.0.1 only:
    torch's own listens on ``[::]``, where a client's v4-mapped address has no /etc/hosts
    entry, so the store's reverse lookup of each client went to DNS (5 s when one is lost)."""
    from dtrain.dist.stores import LOOPBACK, host_store

    store = host_store(LOOPBACK, 0, timeout_s)
    return store, int(store.port)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    results: Any,
    init_group: bool,
    timeout_s: float,
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GROUP_RANK": "0",
            # The store is hosted by the parent (as torch's elastic agent hosts it), so it
            # outlives any rank: a rank that dies can still be named by the others.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    os.environ.update(env)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init_group and world_size > 1:
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        value = fn(*args)
        # Pickled here, by value: through the queue's own pickler, a tensor would travel as a
        # handle to this process's memory, which the parent could no longer open once this
        # rank has exited (torch.multiprocessing's sharing, registered once torch._dynamo --
        # preloaded -- imports it).
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    init_group: bool = True,
    collective_timeout: float = 60.0,
    raise_on_failure: bool = True,
) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size-1]``; ``fn`` must be importable (a
    module-level function). Raises :class:`RankFailed` naming the first rank that failed; with
    ``raise_on_failure=False`` waits for every rank instead and puts a :class:`RankFailed` in
    the place of each rank that raised, died or timed out."""
    ctx = _context()
    results = ctx.Queue()
    store, port = loopback_store(timeout)
    procs = [
        ctx.Process(
            target=_child,
            args=(
                rank,
                world_size,
                port,
                fn,
                args,
                dict(env or {}),
                results,
                init_group,
                collective_timeout,
            ),
            name=f"rank{rank}",
            # Not daemonic, so a rank may start DataLoader workers; every rank is joined or
            # killed before run_ranks returns.
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout

    def record(status: str, rank: int, value: Any) -> None:
        if status == "error":
            failure = RankFailed(f"rank {rank} failed:\n{value}")
            if raise_on_failure:
                raise failure
            values[rank] = failure
        else:
            # From this test's own child process, through a multiprocessing pipe (no socket):
            # nothing another user or host can write.
            values[rank] = pickle.loads(value)

    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                failure = RankFailed(f"rank(s) {missing} did not finish within {timeout:.0f}s")
                if raise_on_failure:
                    raise failure
                for rank in missing:
                    values[rank] = failure
                break
            try:
                record(*results.get(timeout=min(0.2, remaining)))
                continue
            except queue.Empty:
                pass
            for rank, proc in enumerate(procs):
                if rank in values or proc.exitcode is None:
                    continue
                # Exited: give a message in flight a moment to land, else it died silently.
                try:
                    record(*results.get(timeout=1.0))
                except queue.Empty:
                    failure = RankFailed(
                        f"rank {rank} died with exit code {proc.exitcode} and no result"
                    )
                    if raise_on_failure:
                        raise failure from None
                    values[rank] = failure
        return [values[r] for r in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=5.0 if len(values) == world_size else 0.1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5.0)
        results.close()
        del store
