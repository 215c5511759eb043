"""Worker runtime: process group, device, thread count and the rank helpers the rest uses.

Everything here reads the environment torch's elastic launcher sets (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), so a worker started by ``dtrain train`` and
one started by plain ``torchrun`` behave the same. A single process without those variables
runs as world size 1 with no process group at all.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtrain.config import DistConfig
from dtrain.dist.reachability import (
    REACH,
    check_store,
    close_probe_listener,
    open_store,
    peers_checked,
)
from dtrain.errors import ConfigError


@dataclass(frozen=True)
class Runtime:
    """What a worker knows of its place in the job once the process group is up."""

    rank: int
    world_size: int
    device: torch.device
    timeout: datetime.timedelta  # of every collective, and of the groups made later

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def threads_per_worker(local_world_size: int, requested: int = 0) -> int:
    """The cores of this machine shared out evenly: oversubscribed threads make every rank
    slower (each one's matmuls fight the others' for the same cores)."""
    if requested > 0:
        return requested
    return max(1, available_cores() // max(1, local_world_size))


def core_share(local_rank: int, local_world_size: int, threads: int) -> set[int] | None:
    """The cores a CPU worker is bound to: its own equal share of the cores this process may
    run on, in local-rank order; None when a share would hold fewer cores than the worker's
    threads (binding would then crowd them)."""
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // max(1, local_world_size)
    if per < max(1, threads) or local_rank >= local_world_size:
        return None
    return set(cores[local_rank * per : (local_rank + 1) * per])


def pin_to_cores(local_rank: int, local_world_size: int, threads: int) -> None:
    """Bind this process (its calling thread, and every thread it starts later: gloo's, the
    watchdog's) to :func:`core_share` (``dist.pin_cores``). Off by default: a bound worker
    cannot leave a core another process is busy on, which on a machine shared with other jobs
    costs more than binding saves."""
    share = core_share(local_rank, local_world_size, threads)
    if share is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, share)


def choose_device(cfg: DistConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("dist.device = 'cuda' but this machine has no usable CUDA device")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def choose_backend(cfg: DistConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        if cfg.backend == "nccl" and device.type != "cuda":
            raise ConfigError("dist.backend = 'nccl' needs CUDA devices; use 'gloo' on CPU")
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def store_hosted_by_launcher() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


# Set by a worker of fault.recovery = 'inplace' for each membership generation (its store is
# the launcher's coordinator, which outlives every generation; dtrain.recovery.inplace).
NAMESPACE_ENV = "DTRAIN_STORE_NAMESPACE"


def store_namespace() -> str:
    """The key prefix of this attempt in the job's key-value store.

    A store hosted by the launcher (torch's agent, plain ``torchrun``) outlives restarts:
    process groups made after the default one (our checkpoint group, any 2-D mesh) leave keys
    that a restarted attempt reads as its own, and its gloo mesh then tries to connect to the
    dead processes of the attempt before ("Connection refused"). There, every restart attempt
    gets its own prefix. ``dtrain train`` has the workers host a fresh store every round
    instead (see launch/launcher.py), where no prefix is needed -- and where one would be wrong:
    the restart count is per machine, and a machine that joins later counts from 0.
    """
    if os.environ.get(NAMESPACE_ENV):
        return os.environ[NAMESPACE_ENV]
    if store_hosted_by_launcher():
        return f"dtrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return "dtrain/"


def place_worker(
    cfg: DistConfig, rank: int, world_size: int, local: tuple[int, int]
) -> tuple[Runtime, str]:
    """This worker's place (its device CUDA's current one, its threads set) and backend, from
    ``local``: its index among its machine's workers, and their count. The same for a worker
    of a restart attempt and one of an in-place generation."""
    device = choose_device(cfg, local[0])
    backend = choose_backend(cfg, device)
    torch.set_num_threads(threads_per_worker(local[1], cfg.threads))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Runtime(rank, world_size, device, datetime.timedelta(seconds=cfg.timeout_s)), backend


def init_group(runtime: Runtime, backend: str, store: Any) -> None:
    """The default process group of ``runtime``'s rank, rendezvousing through ``store``."""
    dist.init_process_group(
        backend=backend,
        rank=runtime.rank,
        world_size=runtime.world_size,
        timeout=runtime.timeout,
        store=store,
        device_id=runtime.device if runtime.device.type == "cuda" else None,
    )


def init_runtime(cfg: DistConfig) -> Runtime:
    """Join the process group the launcher prepared (or none, for one plain process)."""
    rank = env_int("RANK", 0)
    world_size = env_int("WORLD_SIZE", 1)
    local_rank = env_int("LOCAL_RANK", 0)
    local_world_size = env_int("LOCAL_WORLD_SIZE", 1)
    runtime, backend = place_worker(cfg, rank, world_size, (local_rank, local_world_size))
    if cfg.pin_cores and runtime.device.type == "cpu" and local_world_size > 1:
        # Before any thread of the process group exists: they inherit the binding.
        threads = threads_per_worker(local_world_size, cfg.threads)
        pin_to_cores(local_rank, local_world_size, threads)
    if world_size > 1 and not dist.is_initialized():
        # Every address this rank needs is checked first, each within dist.connect_timeout_s:
        # an unreachable one is a one-line error naming it, not a hang (reachability.py).
        connect_s = cfg.connect_timeout_s
        hosts_store = not store_hosted_by_launcher() and rank == 0  # else the launcher does
        if not hosts_store:
            check_store(env_int("GROUP_WORLD_SIZE", 1), connect_s)
        store = open_store(
            is_master=hosts_store, timeout=runtime.timeout, connect_timeout_s=connect_s
        )
        reach = dist.PrefixStore(store_namespace() + REACH, store)  # type: ignore[attr-defined]
        with peers_checked(
            reach, rank, world_size, backend, connect_s, hosts_store, namespace=store_namespace()
        ):
            group_store = dist.PrefixStore(store_namespace() + "pg", store)  # type: ignore[attr-defined]
            init_group(runtime, backend, group_store)
    return runtime


def shutdown_runtime() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    close_probe_listener()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
