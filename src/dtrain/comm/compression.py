"""Gradient compression for the strategies that average whole gradients through comm hooks
(``ddp``, ``allreduce``): ``comm.compression`` names the hook, :func:`build_comm_hook` makes it.

What each method sends, its state and how to choose: docs/communication.md, "Fewer bytes". Each
hook counts what it sends in the strategy's :class:`~dtrain.comm.accounting.CommCounter`.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from dtrain.comm.accounting import CommCounter
from dtrain.comm.hooks import Bf16Hook, CommHook, Fp16Hook, MeanHook
from dtrain.comm.powersgd import FACTOR_DTYPES, PowerSGDHook
from dtrain.comm.topk import TopKHook
from dtrain.comm.transport import build_transport
from dtrain.config import CommConfig

HOOKS: dict[str, type[CommHook]] = {
    cls.name: cls for cls in (MeanHook, Fp16Hook, Bf16Hook, PowerSGDHook, TopKHook)
}


def build_comm_hook(
    comm: CommConfig,
    timeout: datetime.timedelta,
    counter: CommCounter,
    group: dist.ProcessGroup | None,
    device: torch.device,
    capacity: int,
) -> CommHook:
    """The hook ``comm.compression`` names, counting into ``counter``, over ``group``, its sums
    carried as ``comm.transport`` says; ``capacity``: the largest bucket in bytes, ``timeout``:
    the collectives'. Every rank of ``group`` calls this at once (a transport may agree on its
    set-up with collectives)."""
    hook: CommHook
    if comm.compression == "powersgd":
        rank, start, factors = comm.powersgd_rank, comm.powersgd_start_step, comm.powersgd_factors
        hook = PowerSGDHook(counter, group, device, rank, start, factors=FACTOR_DTYPES[factors])
    elif comm.compression == "topk":
        hook = TopKHook(counter, group, device, comm.topk_fraction)
    else:  # the hooks without settings of their own
        hook = HOOKS[comm.compression](counter, group, device)
    hook.transport = build_transport(comm, timeout, hook.sums_only, group, device, capacity)
    return hook
