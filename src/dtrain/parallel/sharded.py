"""The strategies on one mesh of named dimensions (:mod:`dtrain.parallel.mesh`): ``fsdp``,
``tensor`` and ``pipeline``, whose ranks each hold part of the model and optimizer state (FSDP
shards, tensor-parallel slices, pipeline stages).

Which point of the mesh a strategy trains on follows from its config
(:func:`dtrain.config.layout.strategy_dims`); its state moves through torch's distributed
state-dict API in the sharded form (:mod:`dtrain.checkpoint.model_state`).

What set-up does alike on every point -- keep rank 0's skeleton of the whole model, cut the
layers for tensor parallelism, shard with FSDP, give a meta-built model its values -- is here;
each strategy calls these in torchtitan's order (tensor parallelism, the recipe, FSDP).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from dtrain.checkpoint.forms import Form, Part
from dtrain.config.layout import strategy_dims
from dtrain.parallel.base import Strategy
from dtrain.parallel.grad_norm import local_part
from dtrain.parallel.grad_sync import average_in_buckets
from dtrain.parallel.materialize import is_meta_model, materialize
from dtrain.parallel.mesh import Mesh, build_mesh
from dtrain.parallel.skeleton import ModelSkeleton, meta_copy
from dtrain.parallel.tensor_plan import (
    check_no_dropout,
    check_not_sharded,
    has_plan,
    model_plan,
)
from dtrain.parallel.transposed import back_to_layout, dcp_ready, has_fused_cuts
from dtrain.task import Task


class MeshStrategy(Strategy):
    """A strategy on one mesh whose ranks each hold part of the model and optimizer state."""

    state_form = Form.SHARDED
    state_dict_options: ClassVar[Any] = None  # torch's StateDictOptions, or None for its default

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dims = strategy_dims(self.options, self.runtime.world_size)
        self.mesh: Mesh | None = None  # built in setup (collective)
        self._skeleton: ModelSkeleton | None = None  # rank 0: the full model, on meta
        # Whether a layer is cut inside blocks (GPT-2's fused q|k|v): its pieces are no box
        # of the global tensor, so its state is gathered for DCP and cut again when read.
        self.fused_cuts = False
        # A model without a plan held whole on every rank of the tensor-parallel group rather
        # than refused (a further model of an own loop: dtrain.loop.models).
        self.whole_without_plan = False

    @property
    def sharded(self) -> bool:
        """Whether FSDP holds the parameters (a dp_shard dimension)."""
        return self.dims.dp_shard > 1

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.runtime.rank)

    @property
    def counts_items(self) -> bool:
        # The ranks of one model-parallel group (tp, pp) hold the same items: its first
        # counts them.
        coords = self.coords
        return coords["tp"] == 0 and coords["pp"] == 0

    @property
    def data_parallel_rank(self) -> int:
        return self.dims.dp_rank(self.runtime.rank)

    @property
    def data_parallel_size(self) -> int:
        return self.dims.dp

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.dp_group

    # -- set-up, in the order each strategy calls them ------------------------------------

    def _start_setup(self, model: nn.Module) -> nn.Module | None:
        """Build the mesh (collective), keep rank 0's skeleton of the whole model and move the
        model to the device; returns the meta copy ``_finish_setup`` initializes from when
        the model is meta-built (it is then cut and sharded while still on meta, and each rank
        makes its part only), else None."""
        skeleton = meta_copy(model) if is_meta_model(model) else None
        if skeleton is None:
            model.to(self.runtime.device)
        self.mesh = build_mesh(self.dims, self.runtime.device)
        if self.runtime.is_main:
            self._skeleton = ModelSkeleton(model)
        return skeleton

    def _cut_tensor_parallel(self, model: nn.Module, held_only: bool = False) -> None:
        """Cut the layers the model's plan names over ``tp`` (``held_only``: those this rank
        holds parameters of: a pipeline stage's)."""
        if self.dims.tp == 1:
            return
        assert self.mesh is not None
        if self.whole_without_plan and not has_plan(model):
            check_no_dropout(model)  # its whole copies would draw different masks too
            return
        styles = model_plan(model, self.dims.tp, held_only=held_only)
        check_no_dropout(model)
        if self.sharded:
            check_not_sharded(model, styles)
        tp_mesh = self.mesh.submesh("tp")
        if tp_mesh is not None:
            parallelize_module(model, tp_mesh, styles)
            self.fused_cuts = has_fused_cuts(model)

    def _fully_shard(self, units: Iterable[nn.Module], root: nn.Module) -> None:
        """FSDP over ``dp_shard`` (x ``dp_replicate``: hybrid): each unit, then ``root``, which
        holds only what is left (torchtitan's order); ``strategy.reshard_after_forward``.

        ``strategy.backward_prefetch = false`` tells each unit to prefetch itself (already
        gathered when its backward begins: nothing), so a rank holds one block less at FSDP's
        peak (:mod:`dtrain.estimate.fsdp`); torch has no switch for it, and an empty list
        means its default (the next unit in reverse forward order)."""
        assert self.mesh is not None
        mesh = self.mesh.submesh("dp_replicate", "dp_shard")
        reshard = self.options.reshard_after_forward
        for unit in [*units, root]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        if not self.options.backward_prefetch:
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.set_modules_to_backward_prefetch([module])

    def _finish_setup(self, task: Task, model: nn.Module, skeleton: nn.Module | None) -> None:
        """A meta-built model's values, each rank its part (:mod:`.materialize`)."""
        if skeleton is not None:
            materialize(skeleton, model, task.init_weights, self.runtime.device, self.recipe.seed)
        self.module = self.model = model

    # -- the step ------------------------------------------------------------------------

    def _average_copies(self, params: Iterable[nn.Parameter]) -> None:
        """Without FSDP (which reduce-scatters in backward), the data-parallel copies average
        their gradients after the step's backward, in buckets."""
        if self.dims.dp > 1 and not self.sharded:
            grads = [local_part(p.grad) for p in params if p.grad is not None]
            average_in_buckets(grads, self.data_parallel_group, self.options.bucket_mb)

    # -- state ---------------------------------------------------------------------------

    @property
    def settings_per_name(self) -> bool:
        """Whether its optimizer state is keyed parameter by parameter (pipeline: a stage holds
        some of them) rather than as torch's list of groups (fsdp, tensor)."""
        options = self.state_dict_options
        return bool(options is not None and options.flatten_optimizer_state_dict)

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> dict[str, Part]:
        """Every rank gives its part of the model and optimizer state, in a form DCP saves and
        loads in place."""
        model_state, optim_state = self._torch_state(optimizer, self.state_dict_options)
        if self.fused_cuts:
            model_state, optim_state = dcp_ready(model_state), dcp_ready(optim_state)
        return {
            "model": Part(Form.SHARDED, model_state),
            "optimizer": Part(Form.SHARDED, optim_state),
        }

    def load_state_dicts(self, optimizer: torch.optim.Optimizer, states: dict[str, Any]) -> None:
        """Apply a state filled by DCP (see :meth:`state_dicts`)."""
        options = self.state_dict_options
        model_state, optim_state = states["model"], states["optimizer"]
        if self.fused_cuts:
            model_layout, optim_layout = self._torch_state(optimizer, options)
            model_state = back_to_layout(model_state, model_layout)
            optim_state = back_to_layout(optim_state, optim_layout)
        self._set_torch_state(optimizer, model_state, optim_state, options)

    def state_dicts_by_name(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        states = super().state_dicts_by_name(optimizer)
        return dcp_ready(states) if self.fused_cuts else states

    def load_state_dicts_by_name(
        self, optimizer: torch.optim.Optimizer, states: dict[str, Any]
    ) -> None:
        if self.fused_cuts:
            states = back_to_layout(states, super().state_dicts_by_name(optimizer))
        super().load_state_dicts_by_name(optimizer, states)

    def model_for_inference(self) -> nn.Module | None:
        """Rank 0 gets the whole trained model, a plain module on CPU (the others: None).
        Collective: the full state is gathered (:meth:`model_state_dict`)."""
        state = self.model_state_dict()
        return None if self._skeleton is None else self._skeleton.fill(state)
