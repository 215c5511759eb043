"""``fsdp``: fully sharded data parallel with torch's FSDP2 (``fully_shard``).

Each block of the model, then the root, becomes a sharding unit: a rank keeps 1/N of every
parameter, gradient and optimizer state, all-gathers a block's parameters just before using it
and reduce-scatters its gradients right after -- the order torchtitan documents (blocks first,
so that the root's unit holds only what is left: embeddings, final norm, head). The math is
data parallelism's: gradients are averaged over ranks, and the trainer's loss scaling makes them
the gradient of the global mean.

Checkpoints are sharded (:class:`~dtrain.parallel.sharded.ShardedStrategy`): one DCP file set
per rank, resharded on load, so a run saved on 4 ranks resumes on 2 or on 1.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from dtrain.parallel.base import BackwardSyncControl, LockstepForward
from dtrain.parallel.materialize import is_meta_model, materialize, require_init
from dtrain.parallel.recipe import model_blocks
from dtrain.parallel.sharded import ShardedStrategy
from dtrain.parallel.skeleton import meta_copy
from dtrain.task import Task


class FSDPStrategy(ShardedStrategy, LockstepForward, BackwardSyncControl):
    """fully sharded data parallel (FSDP2): parameters, gradients and optimizer state 1/N each"""

    name = "fsdp"

    def setup(self, task: Task) -> None:
        device = self.runtime.device
        module = task.model
        # A meta-built model is sharded while still on meta, then each rank makes only its
        # shards (materialize, from a meta copy of the whole model).
        skeleton = meta_copy(module) if is_meta_model(module) else None
        if skeleton is None:
            module = module.to(device)
        mesh = init_device_mesh(device.type, (self.runtime.world_size,))
        units = model_blocks(task, module, "strategy.name = 'fsdp'")
        self.recipe.apply(units)  # activation checkpointing and compile, before sharding
        reshard = self.options.reshard_after_forward
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
        if skeleton is not None:
            init = require_init(module, task.init_weights)
            materialize(skeleton, module, init, device, self.recipe.seed)
        self.module = module
        self.model = module

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        assert self.model is not None
        return self.model.named_parameters()

    def no_backward_sync(self) -> contextlib.AbstractContextManager[None]:
        model = self.model
        assert isinstance(model, FSDPModule)

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

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        norm = super().clip_grad_norm(max_norm)
        # The norm of DTensor gradients is itself a DTensor: its full value is the global norm.
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def model_for_inference(self) -> nn.Module | None:
        # Parameters are gathered in forward: every rank runs the hook in lockstep (same seed,
        # same calls); only rank 0's text is printed.
        return self.model

    # -- state ---------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, Any]:
        """The full (unsharded) state on CPU, on rank 0 (empty on the others). Collective."""
        assert self.model is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        assert self.model is not None
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
