"""``tensor``: tensor parallelism with ``torch.distributed.tensor.parallel`` -- each layer's
weight matrices cut across ranks, Megatron-style (column-wise into a block, row-wise out of
it, so a block costs one all-reduce in forward and one in backward).

The model names what to cut: ``model.tensor_parallel_plan(degree)`` returns ``{module name:
"colwise" | "rowwise"}`` (the built-in GPT: the attention's heads and the MLP's hidden units).
The cut weights become ``DTensor`` shards; activations between the cut layers stay plain
tensors (each style hands back its local output), as does every other parameter, replicated
on every rank of the group. With more ranks than the degree, ``world / degree`` copies train
data parallel on a 2-D mesh (:mod:`dtrain.parallel.mesh`, the ranks of one tensor-parallel
group consecutive; gradients averaged over the copies).

Checkpoints are sharded (DCP), by the full model's names: resharded on load, so a run saved at
one degree resumes at another.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dtrain.config import Config, StrategyConfig
from dtrain.errors import ConfigError
from dtrain.parallel.base import LockstepForward
from dtrain.parallel.grad_norm import clip_to_max_norm, local_part, sum_of_squares
from dtrain.parallel.grad_sync import average_in_buckets
from dtrain.parallel.materialize import is_meta_model, materialize, require_init
from dtrain.parallel.mesh import TENSOR, build_mesh
from dtrain.parallel.sharded import MeshStrategy
from dtrain.parallel.skeleton import ModelSkeleton, meta_copy
from dtrain.task import Task

STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def model_plan(model: nn.Module, degree: int) -> dict[str, ParallelStyle]:
    plan_of = getattr(model, "tensor_parallel_plan", None)
    if not callable(plan_of):
        raise ConfigError(
            f"strategy.name = 'tensor' cannot split {type(model).__name__}: expected a model "
            "with a tensor_parallel_plan(degree) method returning {module name: 'colwise' | "
            "'rowwise'} for the nn.Linear layers to cut"
        )
    try:
        plan = dict(plan_of(degree))
    except ValueError as exc:
        raise ConfigError(f"strategy.tensor_parallel = {degree}: {exc}") from None
    styles: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear) or style not in STYLES:
            raise ConfigError(
                f"{type(model).__name__}.tensor_parallel_plan: {name} = {style!r}; expected an "
                "nn.Linear cut 'colwise' or 'rowwise'"
            )
        cut = module.out_features if style == "colwise" else module.in_features
        if cut % degree:
            raise ConfigError(
                f"strategy.tensor_parallel = {degree}: {name} has {cut} features to cut "
                f"{style}, not a multiple of {degree}"
            )
        styles[name] = STYLES[style]()
    return styles


def check_no_dropout(model: nn.Module) -> None:
    """Every rank of a tensor-parallel group computes the replicated activations itself; with
    dropout each would draw its own mask, and the copies would drift apart."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            raise ConfigError(
                f"strategy.name = 'tensor' needs a model without dropout, but {name} drops "
                f"p = {module.p}: the ranks of a tensor-parallel group would draw different "
                "masks for the activations they all hold; set the model's dropout to 0"
            )


class TensorParallelStrategy(MeshStrategy, LockstepForward):
    """tensor parallel (torch.distributed.tensor.parallel), x data parallel on a 2-D mesh"""

    name = "tensor"
    inner_dim = TENSOR

    @classmethod
    def validate_config(cls, cfg: Config, world_size: int) -> None:
        # The base's checks, at the data-parallel size (the mesh's other dimension splits
        # layers, not batches).
        super().validate_config(cfg, cls.mesh_shape_of(cfg.strategy, world_size).dp)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skeleton: ModelSkeleton | None = None  # rank 0: the full model, on meta

    # -- topology ------------------------------------------------------------------------

    @classmethod
    def inner_size(cls, options: StrategyConfig) -> int:
        return options.tensor_parallel

    @property
    def _tp_group(self) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.inner_group

    # -- set-up --------------------------------------------------------------------------

    def setup(self, task: Task) -> None:
        device = self.runtime.device
        model = task.model
        # A meta-built model is cut while still on meta; each rank then makes its slices.
        skeleton = meta_copy(model) if is_meta_model(model) else None
        if skeleton is None:
            model = model.to(device)
        styles = model_plan(model, self.shape.inner)
        check_no_dropout(model)
        if self.runtime.is_main:
            self._skeleton = ModelSkeleton(model)
        self.mesh = build_mesh(self.shape, self.runtime.rank, device)
        if self.mesh.inner_mesh is not None:  # None in a single process: nothing to cut
            parallelize_module(model, self.mesh.inner_mesh, styles)
        if skeleton is not None:
            init = require_init(model, task.init_weights)
            materialize(skeleton, model, init, device, self.recipe.seed)
        self.apply_recipe(task, model)  # after cutting the linear maps, as torchtitan does
        self.module = model
        self.model = model

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.unwrapped.named_parameters()

    # -- the step ------------------------------------------------------------------------

    def sync_gradients(self) -> None:
        if self.data_parallel_size > 1:
            grads = [local_part(p.grad) for p in self.parameters() if p.grad is not None]
            average_in_buckets(grads, self.data_parallel_group, self.options.bucket_mb)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        cut = [local_part(g) for g in grads if _is_sharded(g)]
        whole = [local_part(g) for g in grads if not _is_sharded(g)]
        device = self.runtime.device
        squares = [sum_of_squares(cut, device), sum_of_squares(whole, device)]
        if self._tp_group is not None:
            # Cut gradients: each rank holds a part. Replicated ones are equal on every rank;
            # MAX keeps their sum bit-identical everywhere, as the trainer's NaN guard needs.
            dist.all_reduce(squares[0], group=self._tp_group)
            norm = (squares[0] + squares[1]).sqrt()
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self._tp_group)
        else:
            norm = (squares[0] + squares[1]).sqrt()
        clip_to_max_norm([*cut, *whole], norm, max_norm)
        return norm

    # -- state ---------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, Any]:
        """The full state on CPU, on rank 0 (empty on the others). Collective."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.unwrapped, options=options)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.unwrapped, state, options=options)

    def model_for_inference(self) -> nn.Module | None:
        """Rank 0 gets the whole trained model as a plain module on CPU. Collective."""
        state = self.model_state_dict()
        if self._skeleton is None:
            return None
        return self._skeleton.fill(state)


def _is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements)
