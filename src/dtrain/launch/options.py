"""What ``dtrain train`` is told about the job's machines and workers, checked, and where this
machine stands in it (whether it hosts the rendezvous); the job's settings the launcher acts on."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtrain.dist.network import choose_node_network, local_address, split_endpoint
from dtrain.dist.runtime import available_cores
from dtrain.errors import UserError

if TYPE_CHECKING:
    from dtrain.config import Config


@dataclass(frozen=True)
class LaunchOptions:
    nproc: int
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str = ""
    max_restarts: int = 0
    run_id: str = ""
    rdzv_timeout_s: int = 900
    # The address this node advertises and the interface of its collectives (dist/network.py).
    local_addr: str | None = None
    iface: str = ""


def default_nproc() -> int:
    """One worker per GPU; on CPU, one per core up to 4 (more, smaller workers mostly add
    communication)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, min(available_cores(), 4))


def parse_nnodes(text: str) -> tuple[int, int]:
    try:
        if ":" in text:
            low, high = (int(p) for p in text.split(":", 1))
        else:
            low = high = int(text)
    except ValueError:
        raise UserError(f"--nnodes {text!r}: expected N or MIN:MAX, e.g. 2 or 1:4") from None
    if low < 1 or high < low:
        raise UserError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return low, high


def make_options(
    nproc: int | None,
    nnodes: str,
    node_rank: int | None,
    rdzv_endpoint: str,
    max_restarts: int,
    run_id: str,
    *,
    local_addr: str = "",
    iface: str = "",
    rdzv_timeout_s: int = 900,
) -> LaunchOptions:
    nproc = default_nproc() if nproc is None else nproc
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: the number of workers per machine must be at least 1")
    if max_restarts < 0:
        raise UserError(f"--max-restarts {max_restarts}: must be 0 or more")
    low, high = parse_nnodes(nnodes)
    if high > 1 and not rdzv_endpoint:
        raise UserError(
            "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the rendezvous host, "
            "the same on every machine)"
        )
    if node_rank is not None and node_rank < 0:
        raise UserError(f"--node-rank {node_rank}: must be 0 or more")
    if node_rank is not None and node_rank >= high:
        raise UserError(
            f"--node-rank {node_rank}: must be below --nnodes {nnodes} (0 .. {high - 1})"
        )
    if rdzv_endpoint:
        try:
            split_endpoint(rdzv_endpoint)
        except ValueError:
            raise UserError(f"--rdzv-endpoint {rdzv_endpoint!r}: expected HOST:PORT") from None
    if rdzv_timeout_s < 1:
        raise UserError(f"--rdzv-timeout {rdzv_timeout_s}: must be at least 1 second")
    if "/" in run_id or "\\" in run_id or run_id in (".", ".."):
        # The id also names the run folder (runs/<run id>) where run.dir is not set.
        raise UserError(
            f"--run-id {run_id!r}: must be a plain name (no '/', not '.' or '..'): it also "
            "names the run folder runs/<run id>; set --run.dir=PATH for a folder elsewhere"
        )
    node_addr, iface = choose_node_network(rdzv_endpoint, local_addr, iface)
    return LaunchOptions(
        nproc=nproc,
        min_nodes=low,
        max_nodes=high,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        run_id=run_id or uuid.uuid4().hex[:12],
        rdzv_timeout_s=rdzv_timeout_s,
        local_addr=node_addr,
        iface=iface,
    )


@dataclass(frozen=True)
class JobSettings:
    """What the launcher takes from the job's config. ``grace_s``: how long workers get to
    save and exit after a preemption signal, before they are killed; ``preempt_signals``: the
    signals forwarded to them besides those torch's agent forwards anyway;
    ``collective_timeout_s``: the workers' ``dist.timeout_s`` (the launcher outlasts any outage
    they ride through); ``recovery``: the layout of the agents (``fault.recovery``);
    ``min_replicas``: in place, the fewest workers the job trains with."""

    grace_s: float = 120.0
    preempt_signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1")
    collective_timeout_s: float = 300.0
    recovery: str = "restart"
    min_replicas: int = 1

    @classmethod
    def of(cls, cfg: Config) -> JobSettings:
        return cls(
            grace_s=cfg.fault.preempt_grace_s,
            preempt_signals=tuple(cfg.fault.preempt_signals),
            collective_timeout_s=cfg.dist.timeout_s,
            recovery=cfg.fault.recovery,
            min_replicas=cfg.fault.min_replicas,
        )


def nnodes_text(opts: LaunchOptions) -> str:
    """``--nnodes`` as the user wrote it: N, or MIN:MAX."""
    if opts.min_nodes == opts.max_nodes:
        return str(opts.max_nodes)
    return f"{opts.min_nodes}:{opts.max_nodes}"


def hosts_rendezvous(opts: LaunchOptions) -> bool:
    """Whether this machine hosts the rendezvous: the one with ``--node-rank 0``, unless the
    endpoint is not one of its addresses -- a rendezvous run apart from the nodes
    (``dtrain rendezvous``), which outlives any of them."""
    return opts.node_rank == 0 and endpoint_is_here(opts)


def may_host_rendezvous(opts: LaunchOptions) -> bool:
    """Whether this machine may host the rendezvous: it does where :func:`hosts_rendezvous`
    says so; without ``--node-rank`` torch decides by the machine's addresses, so any machine
    that has the endpoint's address may."""
    return opts.node_rank in (0, None) and endpoint_is_here(opts)


def endpoint_is_here(opts: LaunchOptions) -> bool:
    return local_address(split_endpoint(opts.rdzv_endpoint)[0]) is not None
