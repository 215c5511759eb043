"""The model-parallel layouts without a pipeline, composed over one mesh: tensor parallelism
(``tp``) inside, FSDP over ``dp_shard``, replicas outside (``dp_replicate``); the strategies
``fsdp`` and ``tensor`` are points of this space (docs/strategies.md describes each).

Set-up applies each part to the model in one order, torchtitan's::

    tensor parallelism    the blocks' linear maps cut over tp (the model's plan)
    recipe                activation checkpointing, then compile, per block
    FSDP                  each block, then the root, over dp_shard (x dp_replicate: HSDP)
    (meta-built model)    each rank makes its part (materialize)

Gradients: FSDP reduce-scatters them over the shards (and all-reduces them over the copies of
a hybrid mesh); without FSDP the data-parallel copies average them in buckets after backward.
The global norm adds each gradient's squares over the dimensions that cut it. Checkpoints are
DCP file sets by the full model's names: a run saved at one layout resumes at another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from dtrain.parallel.base import BackwardSyncControl
from dtrain.parallel.grad_norm import clip_to_max_norm, local_part, mesh_gradient_norm
from dtrain.parallel.recipe import model_blocks
from dtrain.parallel.sharded import MeshStrategy
from dtrain.parallel.sync_batchnorm import apply_sync_batchnorm
from dtrain.task import Task


class ComposedStrategy(MeshStrategy, BackwardSyncControl):
    """Tensor parallel x FSDP x replicas on one mesh (a subclass names the point)."""

    # -- set-up --------------------------------------------------------------------------

    def setup(self, task: Task) -> None:
        model = task.model
        skeleton = self._start_setup(model)
        units = self._units(task, model)
        self._cut_tensor_parallel(model)
        self.recipe.apply(units)
        if self.options.sync_batchnorm:
            assert self.mesh is not None
            apply_sync_batchnorm(model, self.mesh.dp_group)
        if self.sharded:
            self._fully_shard(units, model)
        self._finish_setup(task, model, skeleton)

    def _units(self, task: Task, model: nn.Module) -> list[nn.Module]:
        """The blocks FSDP shards one by one, and the recipe applies to."""
        if self.sharded:
            return model_blocks(task, model, f"strategy.name = {self.name!r}")
        if self.recipe.changes_blocks:
            return model_blocks(task, model, self.recipe.describe())
        return []

    # -- the step ------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_backward_sync(self) -> Iterator[None]:
        model = self.model
        if not isinstance(model, FSDPModule):
            # Without FSDP the copies average after the step's last backward only.
            yield
            return
        # Gradients of accumulation micro-steps stay unsharded and local; the last
        # micro-step reduce-scatters their sum.
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def sync_gradients(self) -> None:
        self._average_copies(self.parameters())

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        assert self.mesh is not None
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = mesh_gradient_norm(grads, self.mesh, self.runtime.device)
        clip_to_max_norm([local_part(g) for g in grads], norm, max_norm)
        return norm

    # -- state ---------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, Any]:
        """The full (unsharded) state on CPU, on rank 0 (empty on the others). Collective."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.unwrapped, options=options)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.unwrapped, state, options=StateDictOptions(full_state_dict=True))


class FSDPStrategy(ComposedStrategy):
    """fully sharded data parallel (FSDP2): parameters, gradients and optimizer state 1/N each"""

    name = "fsdp"


class TensorParallelStrategy(ComposedStrategy):
    """tensor parallel (torch.distributed.tensor.parallel), x data-parallel copies or shards"""

    name = "tensor"
