"""The seam of an opt-in transport: how a comm hook's summing all-reduces travel when
``comm.transport`` names something other than ``'backend'`` (the process group's own
collectives).

A transport is a module registered in :data:`dtrain.ext.TRANSPORTS` under the names it answers
to. The registry is read, and the module imported, by name and only when a run names one, so
the core path imports no transport (and the import graph has no edge back from ``comm`` to
``ext``, whose modules build on this package). A transport module gives the three functions of
:class:`TransportModule`; what it builds is a :class:`SumTransport`.
"""

from __future__ import annotations

import datetime
import importlib
from typing import TYPE_CHECKING, Protocol, cast

from dtrain.config.checks import SUMMING_COMPRESSIONS
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from dtrain.config import CommConfig, Config

BACKEND = "backend"
_REGISTRY = "dtrain.ext"  # its TRANSPORTS: name -> module


class SumTransport(Protocol):
    """Sums a tensor over the hook's group, in place, done when the call returns."""

    def all_reduce_(self, tensor: torch.Tensor, divisor: int = 1) -> torch.Tensor:
        """Sum ``tensor`` over the group, each rank's divided by ``divisor`` first (bit for bit
        ``tensor / divisor``); returns ``tensor``."""
        ...

    def bytes_sent(self, payload: int) -> int:
        """The bytes this rank sends for a sum of ``payload`` bytes (what the strategy's
        :class:`~dtrain.comm.accounting.CommCounter` counts)."""
        ...


class TransportModule(Protocol):
    def check_config(self, cfg: Config, sums_only: bool) -> None:
        """In the parent: a ConfigError where it cannot carry this config's sums (``sums_only``:
        whether the compression's collectives are all summing all-reduces)."""

    def check_machines(self, comm: CommConfig, max_nodes: int, nnodes: str) -> None:
        """In the parent: a UserError where the launch's machines do not suit it."""

    def build(
        self,
        comm: CommConfig,
        timeout: datetime.timedelta,
        sums_only: bool,
        group: dist.ProcessGroup | None,
        device: torch.device,
        capacity: int,
    ) -> SumTransport | None:
        """On every rank of ``group`` at once: the transport, or None where the backend is to
        carry the sums after all; ``capacity``: the largest bucket in bytes."""


def transport_module(name: str) -> TransportModule:
    """The module that carries ``comm.transport = name`` (not ``'backend'``)."""
    registry: dict[str, str] = importlib.import_module(_REGISTRY).TRANSPORTS
    if name not in registry:
        valid = ", ".join(sorted([BACKEND, *registry]))
        raise ConfigError(f"comm.transport = {name!r} is not a transport; valid: {valid}")
    return cast(TransportModule, importlib.import_module(registry[name]))


def check_transport_job(cfg: Config, max_nodes: int, nnodes: str) -> None:
    """The parent's checks of an opt-in ``comm.transport`` (a worker under plain ``torchrun``
    runs them once too): the extension's own rules, after the config package's
    (:func:`dtrain.config.job.validate_job`, which already requires a strategy with comm
    hooks for any transport but the backend)."""
    if cfg.comm.transport == BACKEND:
        return
    module = transport_module(cfg.comm.transport)
    module.check_config(cfg, cfg.comm.compression in SUMMING_COMPRESSIONS)
    module.check_machines(cfg.comm, max_nodes, nnodes)


def build_transport(
    comm: CommConfig,
    timeout: datetime.timedelta,
    sums_only: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
    capacity: int,
) -> SumTransport | None:
    """What carries a hook's sums; None: the process group's collectives."""
    if comm.transport == BACKEND:
        return None
    return transport_module(comm.transport).build(comm, timeout, sums_only, group, device, capacity)
