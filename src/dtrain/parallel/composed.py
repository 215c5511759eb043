"""The model-parallel layouts without a pipeline, composed over one mesh: tensor parallelism
(``tp``) inside, FSDP over the data-parallel shards (``dp_shard``), replicas of the whole
(sharded) model outside (``dp_replicate``) -- FSDP, hybrid sharding (replicate x shard),
FSDP x tensor parallelism, tensor parallelism x replicas. The strategies ``fsdp`` and
``tensor`` are points of this space (:mod:`dtrain.parallel.fsdp`,
:mod:`dtrain.parallel.tensor`).

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
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from dtrain.parallel.base import BackwardSyncControl
from dtrain.parallel.fsdp_prefetch import apply_backward_prefetch
from dtrain.parallel.grad_norm import clip_to_max_norm, local_part, mesh_gradient_norm
from dtrain.parallel.grad_sync import average_in_buckets
from dtrain.parallel.materialize import is_meta_model, materialize, require_init
from dtrain.parallel.mesh import build_mesh
from dtrain.parallel.recipe import model_blocks
from dtrain.parallel.sharded import MeshStrategy
from dtrain.parallel.skeleton import ModelSkeleton, meta_copy
from dtrain.parallel.sync_batchnorm import apply_sync_batchnorm
from dtrain.parallel.tensor_plan import check_no_dropout, model_plan
from dtrain.task import Task


class ComposedStrategy(MeshStrategy, BackwardSyncControl):
    """Tensor parallel x FSDP x replicas on one mesh (a subclass names the point)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skeleton: ModelSkeleton | None = None  # rank 0: the full model, on meta

    @property
    def sharded(self) -> bool:
        """Whether FSDP holds the parameters (a dp_shard dimension)."""
        return self.dims.dp_shard > 1

    # -- set-up --------------------------------------------------------------------------

    def setup(self, task: Task) -> None:
        device = self.runtime.device
        model = task.model
        # A meta-built model is cut and sharded while still on meta; each rank then makes
        # its part only.
        skeleton = meta_copy(model) if is_meta_model(model) else None
        if skeleton is None:
            model = model.to(device)
        if self.runtime.is_main:
            self._skeleton = ModelSkeleton(model)
        self.mesh = build_mesh(self.dims, device)
        units = self._units(task, model)
        tp_mesh = self.mesh.submesh("tp")
        if self.dims.tp > 1:
            styles = model_plan(model, self.dims.tp)
            check_no_dropout(model)
            if tp_mesh is not None:
                parallelize_module(model, tp_mesh, styles)
        self.recipe.apply(units)
        if self.options.sync_batchnorm:
            apply_sync_batchnorm(model, self.mesh.dp_group)
        fsdp_mesh = self.mesh.submesh("dp_replicate", "dp_shard")
        if self.sharded and fsdp_mesh is not None:
            reshard = self.options.reshard_after_forward
            for unit in units:
                fully_shard(unit, mesh=fsdp_mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard)
            apply_backward_prefetch(model, self.options.backward_prefetch)
        if skeleton is not None:
            init = require_init(model, task.init_weights)
            materialize(skeleton, model, init, device, self.recipe.seed)
        self.module = model
        self.model = model

    def _units(self, task: Task, model: nn.Module) -> list[nn.Module]:
        """The blocks FSDP shards one by one, and the recipe applies to."""
        if self.sharded:
            return model_blocks(task, model, f"strategy.name = {self.name!r}")
        if self.recipe.changes_blocks:
            return model_blocks(task, model, self.recipe.describe())
        return []

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.unwrapped.named_parameters()

    # -- the step ------------------------------------------------------------------------

    def no_backward_sync(self) -> contextlib.AbstractContextManager[None]:
        model = self.model
        if not isinstance(model, FSDPModule):
            # Without FSDP the copies average after the step's last backward only.
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def skip_sync() -> Iterator[None]:
            # Gradients of accumulation micro-steps stay unsharded and local; the last
            # micro-step reduce-scatters their sum.
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return skip_sync()

    def sync_gradients(self) -> None:
        if not self.sharded and self.dims.dp > 1:
            grads = [local_part(p.grad) for p in self.parameters() if p.grad is not None]
            average_in_buckets(grads, self.data_parallel_group, self.options.bucket_mb)

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

    def model_for_inference(self) -> nn.Module | None:
        """Rank 0 gets the whole trained model as a plain module on CPU. Collective."""
        state = self.model_state_dict()
        if self._skeleton is None:
            return None
        return self._skeleton.fill(state)
