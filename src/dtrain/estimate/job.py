"""What every part of an estimate shares: the config, the strategy's layout at the world size,
the task built on the meta device, the prober of its passes, and the rules of state that more
than one strategy follows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.config import Config
from dtrain.config.layout import ParallelDims
from dtrain.estimate.kernels import kernel_bytes
from dtrain.estimate.layout import (
    OptimizerBytes,
    TensorInfo,
    bucket_bytes,
    optimizer_bytes,
)
from dtrain.estimate.passes import Prober
from dtrain.estimate.result import Line, MemoryEstimate
from dtrain.task import Task

CPU = torch.device("cpu")


@dataclass
class Job:
    """What every part of an estimate needs: the config, the layout, the task built on the
    meta device, the prober of its passes and its tensors."""

    cfg: Config
    world_size: int
    dims: ParallelDims
    task: Task
    prober: Prober
    infos: list[TensorInfo]
    every: int  # the configured activation checkpointing (0: none, K: every K-th block)

    @property
    def checkpointing(self) -> tuple[str, str]:
        """The configured activation checkpointing and the other choice, as the config
        names them."""
        return self.cfg.train.activation_checkpointing, "none" if self.every else "full"

    @property
    def built_on_meta(self) -> bool:
        """Whether ``dtrain train`` gets the model on the meta device: the task gives
        ``init_weights`` (the built-in GPT task with ``meta_init``), and each rank then makes
        only its part."""
        return self.task.init_weights is not None

    def state(
        self, tp: int, shards: int, infos: Sequence[TensorInfo] | None = None
    ) -> tuple[int, int, int, OptimizerBytes, list[Line]]:
        """(parameters, buffers, gradients, optimizer) of one rank holding ``infos`` (all:
        None), cut ``tp`` ways and sharded over ``shards`` ranks (buffers stay whole), and the
        estimate's lines of them (buffers where there are any)."""
        infos = self.infos if infos is None else infos
        params = sum(t.local_bytes(tp, shards) for t in infos if t.is_parameter)
        buffers = sum(t.bytes for t in infos if not t.is_parameter)
        grads = sum(t.local_bytes(tp, shards) for t in infos if t.is_parameter and t.trainable)
        optim = optimizer_bytes(infos, self.cfg.optim, tp, shards, CPU)
        state = [("parameters", params), ("buffers", buffers), ("gradients", grads)]
        optimizer = (f"optimizer state ({self.cfg.optim.name})", optim.state)
        lines = [
            Line(what, size) for what, size in [*state, optimizer] if size or what != "buffers"
        ]
        return params, buffers, grads, optim, lines

    def kernels(self, products: int, lines: list[Line]) -> int:
        """oneDNN's kernels for ``products`` distinct bfloat16 matrix products (:mod:`.kernels`),
        their line added to ``lines`` where they take any memory."""
        size = kernel_bytes(products, self.prober.precision)
        if size:
            what = f"oneDNN's kernels for {products} distinct bfloat16 matrix products (CPU)"
            lines.append(Line(what, size))
        return size

    def setup(self, mine: int, relaid: bool) -> int:
        """Set-up's peak: a model built eagerly is whole on every rank before the strategy
        cuts it (``relaid``: and the rank's part is made beside it); a meta-built one is
        made part by part, one module's own tensors whole at a time."""
        if self.built_on_meta:
            return mine + self.largest_module()
        return sum(t.bytes for t in self.infos) + (mine if relaid else 0)

    def largest_module(self) -> int:
        best = 0
        for module in self.task.model.modules():
            own = {id(t): t for t in (*module.parameters(False), *module.buffers(False))}
            best = max(best, sum(t.numel() * t.element_size() for t in own.values()))
        return best

    def largest_bucket(self, infos: Sequence[TensorInfo], tp: int = 1) -> int:
        """The largest flat bucket the tensors are averaged in (``strategy.bucket_mb``, or
        one tensor larger than that): a transient copy."""
        return max(bucket_bytes(infos, self.bucket_cap, tp=tp), default=0)

    @property
    def bucket_cap(self) -> int:
        return max(1, int(self.cfg.strategy.bucket_mb * 2**20))

    def parameter_count(self) -> int:
        return sum(math.prod(t.shape) for t in self.infos if t.is_parameter)

    def estimate(self, **fields: Any) -> MemoryEstimate:
        """A :class:`MemoryEstimate` with what every strategy's shares filled in."""
        configured, other = self.checkpointing
        return MemoryEstimate(
            strategy=self.cfg.strategy.name,
            world_size=self.world_size,
            mesh=self.dims.describe(),
            precision=self.cfg.train.precision,
            activation_checkpointing=configured,
            other_checkpointing=other,
            parameter_count=self.parameter_count(),
            **fields,
        )
