"""The strategy interface: how a model is spread over ranks, and nothing else.

A strategy wraps the model, synchronizes gradients after the step's backward, lays out the
model's and optimizer's state in checkpoints, and gives the model for evaluation and inference.
The trainer runs the step itself -- forward, loss and backward over the micro-batches, the same
for every strategy (:mod:`dtrain.train.step`) -- and talks to a strategy only through
:class:`Strategy`; it never asks which one it has.

What only some strategies can do is a capability, each a small class a strategy also derives
from and the trainer tests with ``isinstance`` (in the manner of Lightning Fabric's
``_BackwardSyncControl``):

=====================  ======================================================================
capability             what it gives                                       who
=====================  ======================================================================
BackwardSyncControl    ``no_backward_sync()``: accumulation micro-steps    ddp, allreduce, fsdp
                       without gradient sync
CommHookControl        gradients through comm hooks: ``comm.compression``, ddp, allreduce
                       ``register_comm_hook()``, the hook's state in
                       checkpoints, the step's agreement carried with the
                       last bucket
UnevenShares           ranks may hold different shares of a batch and run  ddp, allreduce
                       different numbers of micro-steps (load balancing)
LockstepForward        collectives in forward: every rank runs the same     fsdp, pipeline,
                       number of forward passes (evaluation pads)          tensor
ShardedState           ranks hold different parts of the model state        fsdp, pipeline,
                       (checkpoints through DCP; its traffic runs inside    tensor
                       torch, so ``comm`` does not count all of it)
OwnStep                the strategy runs the step's micro-batches itself    pipeline
                       (its schedule interleaves them across stages)
=====================  ======================================================================

A subclass sets ``name`` (what ``strategy.name`` says); the registry that looks names up is the
package's ``__init__`` (``build_strategy``), which imports the strategy a run uses: this module
imports none of them.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.state import CheckpointParts
from dtrain.comm.accounting import CommCounter
from dtrain.comm.compression import validate_compression
from dtrain.comm.hooks import CommHook
from dtrain.compute.model_call import call_model
from dtrain.config import CommConfig, Config, StrategyConfig, validate_for_world
from dtrain.dist.runtime import Runtime
from dtrain.errors import ConfigError
from dtrain.parallel.grad_norm import gradient_norm, local_part
from dtrain.parallel.materialize import is_meta_model, materialize, require_init
from dtrain.parallel.recipe import Recipe, model_blocks
from dtrain.parallel.skeleton import meta_copy
from dtrain.parallel.sync_batchnorm import apply_sync_batchnorm
from dtrain.task import Task

LossFn = Callable[[Any, Any], torch.Tensor]


class Strategy(ABC):
    name: ClassVar[str] = ""
    on_mesh: ClassVar[bool] = False  # lays the ranks out on a mesh of named dimensions
    # Can sum BatchNorm's statistics over its data-parallel ranks (strategy.sync_batchnorm):
    # every data-parallel rank runs the same micro-batches, each a forward of the whole model.
    syncs_batchnorm: ClassVar[bool] = False

    @classmethod
    def shards_model(cls, options: StrategyConfig) -> bool:
        """Whether FSDP shards the model's blocks under these options (the keys that tune
        FSDP, e.g. ``strategy.backward_prefetch``, apply)."""
        return False

    @classmethod
    def holds_dtensors(cls, options: StrategyConfig) -> bool:
        """Whether the parameters it trains are cut or sharded over ranks (DTensors): FSDP's
        shards, tensor parallelism's cuts."""
        return cls.shards_model(options)

    def __init__(
        self,
        runtime: Runtime,
        options: StrategyConfig,
        comm: CommConfig,
        recipe: Recipe | None = None,
    ) -> None:
        self.runtime = runtime
        self.options = options  # [strategy]
        self.comm_options = comm  # [comm]
        # What every strategy does to the blocks (activation checkpointing, compile) and the
        # precision every forward runs in; and the seed of a meta-built model's values.
        self.recipe = recipe if recipe is not None else Recipe.plain()
        self.module: nn.Module | None = None  # the user's model, unwrapped
        self.model: nn.Module | None = None  # what a training forward runs through
        # Bytes this rank sends and time it waits on communication (dtrain.comm.accounting):
        # every collective a strategy issues is counted here.
        self.comm = CommCounter()
        self._norm_params: list[nn.Parameter] | None = None  # clip_grad_norm's, once

    @classmethod
    def from_config(cls, cfg: Config, runtime: Runtime) -> Strategy:
        """The strategy, given the config sections it uses (a subclass that needs more takes
        them here)."""
        return cls(runtime, cfg.strategy, cfg.comm, recipe=Recipe.from_config(cfg, runtime.device))

    @classmethod
    def validate_config(cls, cfg: Config, world_size: int) -> None:
        """Reject, in the parent process, a config this strategy cannot run at this world
        size. Data parallel by default: every rank is a data-parallel rank. (A strategy with
        another mesh dimension calls this with its data-parallel size.)"""
        validate_for_world(cfg, world_size)
        if cfg.strategy.dp_replicate != 1 and not cls.on_mesh:
            raise ConfigError(
                f"strategy.dp_replicate = {cfg.strategy.dp_replicate} does not work with "
                f"strategy.name = {cls.name!r}: its data-parallel ranks all hold the whole "
                "model already; it sets the copies of a sharded model (fsdp, or tensor and "
                "pipeline with data_parallel = 'fsdp')"
            )
        hooks = issubclass(cls, CommHookControl)
        if cfg.comm.compression != "none" and not hooks:
            raise ConfigError(
                f"comm.compression = {cfg.comm.compression!r} does not work with "
                f"strategy.name = {cls.name!r}: it takes comm.compression = 'none' only "
                "(gradient compression needs a strategy that all-reduces whole gradients "
                "through comm hooks: ddp or allreduce)"
            )
        if cfg.comm.transport != "backend" and not hooks:
            raise ConfigError(
                f"comm.transport = {cfg.comm.transport!r} does not work with strategy.name = "
                f"{cls.name!r}: it carries the gradient all-reduce of ddp and allreduce only; "
                "use comm.transport = 'backend'"
            )
        if hooks:
            validate_compression(cfg)
        fused_sgd = cfg.optim.implementation == "fused" and cfg.optim.name == "sgd"
        if fused_sgd and cls.holds_dtensors(cfg.strategy):
            raise ConfigError(
                f"optim.implementation = 'fused' with optim.name = 'sgd' does not work with "
                f"strategy.name = {cls.name!r}: torch has no fused SGD for the sharded "
                "parameters (DTensors) it trains; use optim.implementation = 'foreach', or adamw"
            )
        if cfg.strategy.sync_batchnorm:
            check_sync_batchnorm(cls, cfg)
        if not cfg.strategy.backward_prefetch:
            check_backward_prefetch(cls, cfg)
        if cfg.balance.mode != "off" and not issubclass(cls, UnevenShares):
            raise ConfigError(
                f"balance.mode = {cfg.balance.mode!r} does not work with strategy.name = "
                f"{cls.name!r}: per-rank batch shares need a strategy whose ranks may run "
                "different numbers of micro-steps (ddp or allreduce); use balance.mode = 'off'"
            )

    # -- topology ------------------------------------------------------------------------

    @property
    def data_parallel_rank(self) -> int:
        return self.runtime.rank

    @property
    def data_parallel_size(self) -> int:
        return self.runtime.world_size

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        return None  # the default (world) group

    @property
    def counts_items(self) -> bool:
        """Whether this rank's items count towards a step's global item count: each item is
        counted once, by one rank of the ranks that hold it (all of them, in data parallel)."""
        return True

    # -- set-up --------------------------------------------------------------------------

    @abstractmethod
    def setup(self, task: Task) -> None:
        """Move the model to the device and wrap it; sets ``module`` and ``model``."""

    def build_replica(self, task: Task) -> nn.Module:
        """The whole model on this rank's device with the recipe applied: what a replicated
        strategy wraps. A meta-built model gets its values here (:mod:`.materialize`)."""
        model = task.model
        if is_meta_model(model):
            init = require_init(model, task.init_weights)
            materialize(meta_copy(model), model, init, self.runtime.device, self.recipe.seed)
        else:
            model = model.to(self.runtime.device)
        self.apply_recipe(task, model)
        if self.options.sync_batchnorm:
            apply_sync_batchnorm(model, self.data_parallel_group)
        return model

    def apply_recipe(self, task: Task, model: nn.Module) -> None:
        """Activation checkpointing and compile on the model's blocks, in place, where the
        config asks for them (after tensor parallelism, before the data-parallel wrapper)."""
        if self.recipe.changes_blocks:
            self.recipe.apply(model_blocks(task, model, self.recipe.describe()))

    def before_first_step(self, micro_batch: tuple[Any, Any], loss_fn: LossFn) -> None:
        """Called once, with the first micro-batch, before this process's first step (DDP
        settles its buckets here). Default: nothing."""
        return None

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this rank's optimizer updates."""
        assert self.model is not None
        return self.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.unwrapped.named_parameters()

    @property
    def unwrapped(self) -> nn.Module:
        assert self.module is not None, "setup() has not run"
        return self.module

    def parameter_bytes(self) -> int:
        """Bytes of parameters this rank holds (of a sharded parameter, its local part)."""
        return sum(local_part(p).numel() * p.element_size() for p in self.parameters())

    # -- after the step's backward -------------------------------------------------------

    def sync_gradients(self) -> None:
        """After the step's last backward: complete what backward started, so that every
        rank holds its synchronized gradients. The trainer scales each rank's loss by
        ``data_parallel_size / global items``, so an averaging sync gives the gradient of the
        global mean. Default: nothing (a wrapper synchronized them in backward)."""
        return None

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm (0 = only measure it); returns the norm, the same
        on every rank (the trainer's NaN guard takes the same branch everywhere on it)."""
        if self._norm_params is None:
            # The same parameter objects for the whole run (a rollback loads values into them).
            self._norm_params = list(self.parameters())
        if max_norm > 0:
            params = [p for p in self._norm_params if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return gradient_norm([p.grad for p in self._norm_params if p.grad is not None])

    def after_optimizer_step(self, step: int) -> None:
        """Called by the trainer after each step's update (or its skip by the NaN guard) with
        the step just finished, counted from the start of the run (a resumed run calls it with
        the same numbers). Strategies that synchronize every few steps (``localsgd``,
        ``diloco``) do it here; collective for them. Default: nothing."""
        return None

    # -- collectives the trainer asks for ------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel group, in place; returns the tensor."""
        if self.data_parallel_size > 1:
            with self.comm.waiting():
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.data_parallel_group)
            self.comm.all_reduce(tensor.numel() * tensor.element_size(), self.data_parallel_size)
        return tensor

    def all_reduce_loss(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a loss total over every rank that computes part of it, in place."""
        self.start_loss_all_reduce(tensor)()
        return tensor

    def start_loss_all_reduce(self, tensor: torch.Tensor) -> Callable[[], None]:
        """:meth:`all_reduce_loss` started, not waited for: call what it returns to wait.
        Data parallel: the data-parallel group. (A pipeline computes the loss on its last
        stage only, and overrides this to sum over stages as well.)"""
        if self.data_parallel_size == 1:
            return self._waiter(None)
        work = dist.all_reduce(
            tensor, op=dist.ReduceOp.SUM, group=self.data_parallel_group, async_op=True
        )
        self.comm.all_reduce(tensor.numel() * tensor.element_size(), self.data_parallel_size)
        return self._waiter(work)

    def _waiter(self, work: dist.Work | None) -> Callable[[], None]:
        """A function that waits for ``work`` (None: nothing was sent), counting the wait as
        communication."""

        def wait() -> None:
            if work is not None:
                with self.comm.waiting():
                    work.wait()

        return wait

    # -- evaluation and inference --------------------------------------------------------

    @torch.no_grad()
    def agree_on_buffers(self) -> None:
        """Before an evaluation: every data-parallel rank takes the first one's buffers
        (BatchNorm's running statistics, which each rank updates from its own share unless
        ``strategy.sync_batchnorm``), the ones a checkpoint saves -- so that the evaluation
        is the saved model's. Collective over the data-parallel group. Training does not
        read running statistics, so its math does not change."""
        if self.data_parallel_size == 1 or not dist.is_initialized():
            return
        for buffer in self.unwrapped.buffers():
            if type(buffer) is not torch.Tensor or buffer.is_meta:
                continue  # a DTensor's parts are laid out by its own mesh
            with self.comm.waiting():
                dist.broadcast(buffer, group=self.data_parallel_group, group_src=0)
            self.comm.broadcast(buffer.numel() * buffer.element_size(), self.data_parallel_size)

    @torch.no_grad()
    def eval_loss(self, batch: tuple[Any, Any], loss_fn: LossFn) -> torch.Tensor:
        """Summed loss of one evaluation batch on this rank (no gradient sync involved)."""
        inputs, targets = batch
        with self.recipe.precision.autocast():
            return loss_fn(call_model(self.unwrapped, inputs), targets).sum()

    def model_for_inference(self) -> nn.Module | None:
        """The model to run the task's after-training hook with on this rank, or None when
        this rank does not run it. Collective: every rank calls it. Default: the unwrapped
        model on rank 0."""
        return self.unwrapped if self.runtime.is_main else None

    # -- state ---------------------------------------------------------------------------

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> CheckpointParts:
        """What this rank writes of the model and optimizer into a checkpoint. Replicated (this
        default): every rank holds the same, so rank 0 writes both whole, as ``model.pt`` and
        ``optimizer.pt``. (:class:`ShardedState` strategies override.)"""
        parts = CheckpointParts()
        if self.runtime.is_main:
            parts.files[layout.MODEL_FILE] = self.model_state_dict()
            parts.files[layout.OPTIMIZER_FILE] = self.optimizer_state_dict(optimizer)
        return parts

    def load_checkpoint_parts(self, optimizer: torch.optim.Optimizer, step_dir: Path) -> None:
        """Load the model and optimizer from what :meth:`checkpoint_parts` wrote into
        ``step_dir``; a model that does not fit is named key by key."""
        if not (step_dir / layout.MODEL_FILE).exists():  # a sharded strategy's shards
            from dtrain.parallel.cross_form import load_shards_into_replica

            load_shards_into_replica(self.unwrapped, optimizer, step_dir)
            return
        model_state = ckread.load_file(step_dir, layout.MODEL_FILE)
        ckread.check_model_fits(self.model_state_dict(), model_state, step_dir)
        self.load_model_state_dict(model_state)
        self.load_optimizer_state_dict(optimizer, ckread.load_file(step_dir, layout.OPTIMIZER_FILE))

    def model_state_dict(self) -> dict[str, Any]:
        return self.unwrapped.state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.unwrapped.load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """torch's whole state dict, with each group's parameter names beside it (so that a
        sharded strategy can read it: :mod:`.cross_form`)."""
        from dtrain.parallel.cross_form import with_param_names

        return with_param_names(optimizer.state_dict(), optimizer, self.named_parameters())

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)


def check_sync_batchnorm(cls: type[Strategy], cfg: Config) -> None:
    """``strategy.sync_batchnorm`` where it cannot give one process's math is a config error."""
    if not cls.syncs_batchnorm:
        raise ConfigError(
            f"strategy.sync_batchnorm = true does not work with strategy.name = {cls.name!r}: "
            "BatchNorm's statistics are summed over the data-parallel ranks of ddp, allreduce "
            "and fsdp only"
        )
    if cfg.balance.mode != "off":
        raise ConfigError(
            f"strategy.sync_batchnorm = true does not work with balance.mode = "
            f"{cfg.balance.mode!r}: every rank must run the same micro-steps for the "
            "statistics to be summed over all of them; use balance.mode = 'off'"
        )


def check_backward_prefetch(cls: type[Strategy], cfg: Config) -> None:
    """``strategy.backward_prefetch = false`` where no FSDP shards the model is a config
    error: it would change nothing."""
    if not cls.shards_model(cfg.strategy):
        raise ConfigError(
            f"strategy.backward_prefetch = false does not work with strategy.name = "
            f"{cls.name!r}"
            + (f" and data_parallel = {cfg.strategy.data_parallel!r}" if cls.on_mesh else "")
            + ": it sets when FSDP gathers a sharded model's blocks in backward (fsdp, or "
            "tensor and pipeline with data_parallel = 'fsdp'); remove it"
        )


# -- capabilities ---------------------------------------------------------------------------


class BackwardSyncControl(ABC):
    """Capability: run a backward pass without synchronizing gradients."""

    @abstractmethod
    def no_backward_sync(self) -> contextlib.AbstractContextManager[None]: ...


class CommHookControl(Strategy):
    """Capability: gradients are averaged through a communication hook, ``hook(state,
    bucket) -> Future[Tensor]`` (DDP's shape): the one ``comm.compression`` names, or one
    registered with :meth:`register_comm_hook`. A hook of ours (:class:`CommHook`) counts its
    bytes, may keep training state (error feedback: saved per rank, ``comm-rankNNNNN.pt``)
    and carries the step's agreement with its last bucket (:mod:`dtrain.train.step`)."""

    comm_state: Any = None  # the hook's state (a CommHook, or what a registered hook takes)

    @abstractmethod
    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Use ``hook(state, bucket)`` instead of the hook ``comm.compression`` names; before
        the first step. Its bytes are not counted unless it counts them itself."""

    @property
    def comm_hook_of_ours(self) -> CommHook | None:
        """The hook's state when it is one of ours, else None."""
        return self.comm_state if isinstance(self.comm_state, CommHook) else None

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> CheckpointParts:
        parts = super().checkpoint_parts(optimizer)
        hook = self.comm_hook_of_ours
        if hook is not None and hook.stateful:  # every rank: residuals differ between ranks
            parts.files[layout.comm_file(self.data_parallel_rank)] = {
                "layout": self._comm_layout(hook),
                "hook": hook.state_dict(),
            }
        return parts

    def load_checkpoint_parts(self, optimizer: torch.optim.Optimizer, step_dir: Path) -> None:
        """Also restore this rank's hook state when it was saved with the same layout: the
        same method, strategy, bucket size and data-parallel size (residuals are kept per
        bucket, and belong to a rank's share of the data, as RNG streams do). Else, or when
        the checkpoint has none (saved without compression), the hook starts afresh."""
        super().load_checkpoint_parts(optimizer, step_dir)
        hook = self.comm_hook_of_ours
        if hook is None or not hook.stateful:
            return
        name = layout.comm_file(self.data_parallel_rank)
        saved = ckread.load_file(step_dir, name) if (step_dir / name).exists() else {}
        if saved.get("layout") == self._comm_layout(hook):
            hook.load_state_dict(saved["hook"])
        else:
            hook.reset()

    def _comm_layout(self, hook: CommHook) -> dict[str, Any]:
        """What a hook's saved state is only valid under."""
        return {
            "compression": hook.name,
            "strategy": self.name,
            "bucket_mb": self.options.bucket_mb,
            "data_parallel_size": self.data_parallel_size,
        }


class UnevenShares:
    """Capability: ranks may hold different shares of a global batch and run different numbers
    of micro-steps (``balance.mode = 'throughput'``): gradients meet once per step, on each
    rank's last micro-batch, and nothing else in a step is collective."""


class LockstepForward:
    """Capability (a constraint, really): there are collectives in forward (FSDP's
    all-gathers, pipeline sends, tensor-parallel all-reduces), so every rank must run the same
    number of forward passes; evaluation pads with batches computed and not counted."""


class ShardedState:
    """Capability: ranks hold different parts of the model and optimizer state; checkpoints
    go through ``torch.distributed.checkpoint`` (:mod:`dtrain.parallel.sharded`). Their
    collectives run inside torch, so ``comm`` counts only dtrain's own: their totals are left
    out of the metrics rather than understated."""


class OwnStep(ABC):
    """Capability: the strategy runs a step's micro-batches itself, where its schedule
    interleaves them (a pipeline's stages), instead of the trainer's forward/backward loop."""

    @abstractmethod
    def forward_backward(
        self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, scale: torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward over the step's micro-batches, each micro-batch's summed loss
        multiplied by ``scale`` before backward, gradients synchronized; returns this rank's
        summed loss (detached; zero where this rank computes none)."""


def replicated_state(strategy: Strategy) -> bool:
    """Whether every rank holds the whole model and optimizer state (rank 0 saves it)."""
    return not isinstance(strategy, ShardedState)
