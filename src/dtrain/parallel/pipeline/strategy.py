"""``pipeline``: the model cut into consecutive stages on consecutive ranks, with torch's
``torch.distributed.pipelining`` running the micro-batch schedule (GPipe, 1F1B or interleaved
1F1B). With more ranks than stages, ``world / stages`` copies of the pipeline train data
parallel on a 2-D mesh (:mod:`dtrain.parallel.mesh`); each stage's copies are replicas
(gradients all-reduced) or FSDP shards.

One step, on every rank::

    micro-batches (the same on every stage of a pipeline) --stacked--> schedule.step
        first stage: feeds the inputs      last stage: loss = loss_fn(out, tgt).sum() * scale
        activations forward, gradients backward between neighbours (point-to-point)
    data-parallel copies of a stage: average its gradients (or FSDP reduce-scatters them)
    tied parameters (GPT: the embedding and the head, one at each end): sum their gradients
    clip_grad_norm: squared norms summed over stages (a tied parameter counted once)

The training math is one process's: the trainer's ``scale`` makes the summed loss of the whole
global batch the mean, whichever stage or copy computes which part of it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor

from dtrain.comm.plain import gather_tensors
from dtrain.config import CommConfig, Config, DataConfig, StrategyConfig
from dtrain.config.layout import INTERLEAVED, stages_per_rank
from dtrain.dist.runtime import Runtime
from dtrain.errors import UserError
from dtrain.parallel.base import LossFn, OwnStep, Strategy
from dtrain.parallel.grad_norm import clip_to_max_norm, local_part, mesh_gradient_norm
from dtrain.parallel.pipeline.batches import (
    batch_signature,
    check_tensor,
    eval_chunks,
    stack_micro_batches,
)
from dtrain.parallel.pipeline.plan import (
    check_stage_count,
    choose_plan,
    example_input,
)
from dtrain.parallel.pipeline.split import (
    StageChain,
    check_coverage,
    first_names,
    local_parameters,
    model_layers,
    names_in_whole,
    prune_to_stages,
    stage_entries,
    tied_parameters,
)
from dtrain.parallel.pipeline.stages import StagePlan
from dtrain.parallel.pipeline.ties import Tie, make_ties, sum_tied_gradients, uncounted
from dtrain.parallel.recipe import Recipe
from dtrain.parallel.sharded import MeshStrategy
from dtrain.task import Task

_CACHED_SCHEDULES = 8  # distinct batch shapes kept (each holds receive buffers of its shape)


class PipelineStrategy(MeshStrategy, OwnStep):
    """pipeline parallel (torch.distributed.pipelining), x data parallel on a 2-D mesh"""

    name = "pipeline"

    # Optimizer state keyed by parameter name, not by position: each stage holds different
    # parameters, and a name means the same tensor at any pipeline or data-parallel layout.
    state_dict_options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(
        self,
        runtime: Runtime,
        options: StrategyConfig,
        comm: CommConfig,
        recipe: Recipe,
        *,
        data: DataConfig,
    ) -> None:
        super().__init__(runtime, options, comm, recipe)
        self.data_options = data  # [data]: the micro-batches a schedule runs
        self.plan: StagePlan | None = None
        self.num_stages = 1
        self.chains: dict[int, StageChain] = {}  # stage index -> this rank's layers
        self.tied: list[Tie] = []  # parameters this rank shares with other stages
        self._schedules: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._loss_fn: LossFn | None = None
        self._scale: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []

    # -- topology ------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: Config, runtime: Runtime) -> Strategy:
        recipe = Recipe.from_config(cfg, runtime.device)
        return cls(runtime, cfg.strategy, cfg.comm, recipe, data=cfg.data)

    # -- set-up --------------------------------------------------------------------------

    def setup(self, task: Task) -> None:
        model = task.model
        layers = model_layers(model, task.pipeline_layers)
        pp = self.dims.pp
        self.num_stages = pp * stages_per_rank(self.options) if pp > 1 else 1
        check_stage_count(self.num_stages, len(layers), model)
        # A meta-built model is cut while still on meta; each rank then makes its stages.
        skeleton = self._start_setup(model)
        profile = pp > 1 and not self.options.pipeline_boundaries
        profile = profile and self.options.pipeline_balance == "profile"
        if skeleton is not None and profile:
            raise UserError(
                "strategy.pipeline_balance = 'profile' times every layer of the model, which a "
                "meta-built model (Task.init_weights) does not hold on any one rank: set "
                "strategy.pipeline_balance = 'uniform' or strategy.pipeline_boundaries"
            )
        example = None
        if profile:
            data = self.data_options
            rows = data.global_batch_size // (self.dims.dp * data.micro_batches)
            example = example_input(
                task.train_data, task.collate_fn, task.split_batch, rows, self.runtime.device
            )
        self.plan = choose_plan(self.options, layers, self.num_stages, example)
        precision = self.recipe.precision
        all_chains = [StageChain(layers[r.start : r.stop], precision) for r in self.plan.stages()]
        kept = [stage_entries(model, [chain]) for chain in all_chains]
        check_coverage(model, kept)
        self.chains = {s: all_chains[s] for s in range(self.coords["pp"], self.num_stages, pp)}
        my_entries = stage_entries(model, list(self.chains.values()))
        self.tied = make_ties(tied_parameters(kept), self.dims, self.chains, self.runtime.rank)
        first = first_names(model)
        prune_to_stages(model, my_entries)
        self.whole_names = names_in_whole(model, first)  # before FSDP or TP replace tensors
        del all_chains, kept, layers
        self._cut_tensor_parallel(model, held_only=True)
        self.apply_recipe(task, model)  # this rank's blocks; the others' hold no tensors
        if self.sharded:
            for chain in self.chains.values():
                # Per layer, then per stage. A layer that shares a parameter with another of
                # its stage (a one-stage pipeline holds the GPT's tied embedding and head) is
                # sharded with the stage: FSDP keeps a parameter in one unit only.
                shared = shared_parameters(chain.layers)
                units = [
                    layer
                    for layer in chain.layers
                    if (ids := {id(p) for p in layer.parameters()}) and not shared & ids
                ]
                self._fully_shard(units, chain)
        self._finish_setup(task, model, skeleton)

    # -- the step ------------------------------------------------------------------------

    def _stage_loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        with self.recipe.precision.autocast():  # as one process computes it
            loss_sum = self._loss_fn(output, target).sum()
        self._losses.append(loss_sum.detach())
        return loss_sum if self._scale is None else loss_sum * self._scale

    def _schedule(self, kind: str, chunks: int, inputs: Any, targets: Any) -> Any:
        """The schedule (and stages) for this batch shape; made once per shape, since a
        stage's receive buffers have the shape of the first batch it sees."""
        key = (kind, chunks, batch_signature(inputs), batch_signature(targets))
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        assert self.mesh is not None
        stages: list[Any] = [
            PipelineStage(
                chain, index, self.num_stages, self.runtime.device, group=self.mesh.group("pp")
            )
            for index, chain in self.chains.items()
        ]
        name, loss = self.options.pipeline_schedule, self._stage_loss
        if name == INTERLEAVED:
            schedule: Any = ScheduleInterleaved1F1B(stages, chunks, loss, scale_grads=False)
        elif name == "1f1b" and kind == "train":
            schedule = Schedule1F1B(stages[0], chunks, loss, scale_grads=False)
        else:  # GPipe; also every forward-only pass (all schedules run it the same way)
            schedule = ScheduleGPipe(stages[0], chunks, loss, scale_grads=False)
        self._schedules[key] = schedule
        if len(self._schedules) > _CACHED_SCHEDULES:
            self._schedules.popitem(last=False)
        return schedule

    def _run(self, kind: str, chunks: int, inputs: Any, targets: Any) -> torch.Tensor:
        """One pass of the schedule; returns this rank's summed loss (0 without the loss)."""
        for chain in self.chains.values():
            chain.train(self.unwrapped.training)
        schedule = self._schedule(kind, chunks, inputs, targets)
        has_last = self.num_stages - 1 in self.chains
        args = (inputs,) if 0 in self.chains else ()
        target = targets if has_last else None
        self._losses.clear()
        if kind == "train":
            schedule.step(*args, target=target, return_outputs=False)
        else:
            schedule.eval(*args, target=target, return_outputs=False)
        if not has_last:
            return torch.zeros((), device=self.runtime.device)
        # The first pass of a new shape also calls the loss on placeholder data (torch infers
        # the gradient shapes that way): only the last `chunks` calls are the batch's.
        return torch.stack(self._losses[-chunks:]).sum()

    def forward_backward(
        self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, scale: torch.Tensor
    ) -> torch.Tensor:
        self._loss_fn, self._scale = loss_fn, scale
        if self.num_stages == 1:
            total = self._single_stage(micro_batches)
        else:
            inputs, targets = stack_micro_batches(micro_batches)
            total = self._run("train", len(micro_batches), inputs, targets)
        self._sync_gradients()
        return total

    def _single_stage(self, micro_batches: Sequence[tuple[Any, Any]]) -> torch.Tensor:
        """One stage (pipeline_stages = 1): plain data parallelism over the chain."""
        (chain,) = self.chains.values()
        chain.train(self.unwrapped.training)
        total = torch.zeros((), device=self.runtime.device)
        last = len(micro_batches) - 1
        for index, (inputs, targets) in enumerate(micro_batches):
            if isinstance(chain, FSDPModule):
                chain.set_requires_gradient_sync(index == last)
            loss_sum = self._stage_loss(chain(inputs), targets)
            loss_sum.backward()
            total = total + self._losses[-1]
        return total

    def _sync_gradients(self) -> None:
        params = list(local_parameters(self.chains.values()))
        for param in params:
            if param.grad is None and param.requires_grad:
                # A parameter this micro-batch did not reach: its copies must still agree.
                param.grad = torch.zeros_like(param)
        self._average_copies(params)
        sum_tied_gradients(self.tied, self.unwrapped)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        skip = uncounted(self.tied, self.unwrapped)
        grads = [
            p.grad
            for p in local_parameters(self.chains.values())
            if p.grad is not None and id(p) not in skip
        ]
        assert self.mesh is not None
        # Each stage holds other parameters: their squares add up over the pipeline.
        norm = mesh_gradient_norm(grads, self.mesh, self.runtime.device, disjoint=("pp",))
        # Every gradient is scaled: a tied parameter's on each stage that holds it (its norm
        # is counted once).
        every = [p.grad for p in local_parameters(self.chains.values()) if p.grad is not None]
        clip_to_max_norm([local_part(g) for g in every], norm, max_norm)
        return norm

    def start_loss_all_reduce(self, tensor: torch.Tensor) -> Callable[[], None]:
        """The loss is computed on the last stage of every pipeline, and is 0 elsewhere: sum
        over the world (the ranks of a tensor-parallel group hold the same loss: the first's
        counts)."""
        if self.coords["tp"] != 0:
            tensor.zero_()
        if dist.is_initialized() and self.runtime.world_size > 1:
            return self._waiter(dist.all_reduce(tensor, async_op=True))
        return self._waiter(None)

    @torch.no_grad()
    def eval_loss(self, batch: tuple[Any, Any], loss_fn: LossFn) -> torch.Tensor:
        inputs, targets = batch
        self._loss_fn, self._scale = loss_fn, None
        if self.num_stages == 1:
            (chain,) = self.chains.values()
            chain.train(self.unwrapped.training)
            return self._stage_loss(chain(inputs), targets)
        check_tensor(inputs, "inputs")
        chunks = eval_chunks(
            inputs.shape[0],
            self.data_options.micro_batches,
            self.dims.pp,
            self.options.pipeline_schedule == INTERLEAVED,
        )
        return self._run("eval", chunks, inputs, targets)

    # -- state ---------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, Any]:
        """The full model's state on rank 0 (names and order as in the unsplit model), empty on
        the others: every stage's tensors, full (unsharded) and on CPU. Collective."""
        local: dict[str, torch.Tensor] = {}
        for name, tensor in self.unwrapped.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            local[name] = full.detach().cpu()
        pieces: list[dict[str, torch.Tensor]] | None = [local]
        if dist.is_initialized() and self.runtime.world_size > 1:
            # The first copy of the pipeline speaks for all.
            pieces = gather_tensors(local if self.data_parallel_rank == 0 else {}, dst=0)
        if pieces is None:
            return {}
        merged = {name: tensor for piece in pieces for name, tensor in piece.items()}
        assert self._skeleton is not None  # rank 0 kept it
        return {k: merged[k] for k in self._skeleton.model.state_dict() if k in merged}

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        mine = {k: v for k, v in state.items() if k in self.unwrapped.state_dict()}
        set_model_state_dict(
            self.unwrapped, mine, options=StateDictOptions(full_state_dict=True, strict=True)
        )


def shared_parameters(layers: Iterable[nn.Module]) -> set[int]:
    """The ids of the parameters that more than one of ``layers`` holds."""
    seen: set[int] = set()
    shared: set[int] = set()
    for layer in layers:
        ids = {id(p) for p in layer.parameters()}
        shared |= seen & ids
        seen |= ids
    return shared
