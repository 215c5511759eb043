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
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dtrain.model_call import call_model
from dtrain.parallel.base import BackwardSyncControl, LockstepForward, LossFn
from dtrain.parallel.blocks import find_blocks
from dtrain.parallel.sharded import ShardedStrategy
from dtrain.parallel.skeleton import ModelSkeleton
from dtrain.task import Task


class FSDPStrategy(ShardedStrategy, LockstepForward, BackwardSyncControl):
    """fully sharded data parallel (FSDP2): parameters, gradients and optimizer state 1/N each"""

    name = "fsdp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skeleton: ModelSkeleton | None = None  # rank 0: the full model, on meta

    def setup(self, task: Task) -> None:
        device = self.runtime.device
        module = task.model.to(device)
        mesh = init_device_mesh(device.type, (self.runtime.world_size,))
        dtype = torch.bfloat16 if self.options.precision == "bf16" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        units = task.shard_units(module) if task.shard_units else find_blocks(module)
        if self.runtime.is_main:  # the whole model's structure, for model_for_inference
            self._skeleton = ModelSkeleton(module)
        reshard = self.options.reshard_after_forward
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
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
        """Rank 0 gets the whole trained model, unsharded, on CPU (the other ranks: None), as
        a plain module (no FSDP hooks): a hook may save it, or run it alone. Collective."""
        state = self.model_state_dict()
        if self._skeleton is None:
            return None
        return self._skeleton.fill(state)

    @torch.no_grad()
    def eval_loss(self, batch: tuple[Any, Any], loss_fn: LossFn) -> torch.Tensor:
        inputs, targets = batch
        assert self.model is not None
        return loss_fn(call_model(self.model, inputs), targets).sum()

    # -- state ---------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, Any]:
        """The full (unsharded) state on CPU, on rank 0 (empty on the others). Collective."""
        assert self.model is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        assert self.model is not None
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
