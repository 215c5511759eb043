"""The strategy interface: how a model is spread over ranks, and nothing else.

The trainer runs the step itself (:mod:`dtrain.train.step`) and talks to a strategy only
through :class:`Strategy`, never asking which one it has (docs/architecture.md, "The three
invariants"). A capability that carries behaviour is a small class a strategy also derives from
and the trainer tests with ``isinstance`` (as Lightning Fabric's ``_BackwardSyncControl``); the
rest are plain data in the capability record (:mod:`dtrain.config.capabilities`), which the
config's rules read without importing a strategy.

=====================  ======================================================================
capability             what it gives                                       who
=====================  ======================================================================
BackwardSyncControl    ``no_backward_sync()``: accumulation micro-steps    ddp, allreduce, fsdp
                       without gradient sync
CommHookControl        gradients through comm hooks: ``comm.compression``, ddp, allreduce
                       ``register_comm_hook()``, the hook's state in
                       checkpoints (per rank), the step's agreement carried with the
                       last bucket
OwnStep                the strategy runs the step's micro-batches itself    pipeline
                       (its schedule interleaves them across stages)
=====================  ======================================================================

A subclass sets ``name`` (what ``strategy.name`` says); the registry that looks names up is the
package's ``__init__`` (``build_strategy``), which imports the strategy a run uses: this module
imports none of them.
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint.forms import Form, Origin, Part, renamed, with_param_names
from dtrain.comm.accounting import CommCounter
from dtrain.comm.hooks import CommHook
from dtrain.compute.model_call import call_model
from dtrain.config import CommConfig, Config, StrategyConfig
from dtrain.config.capabilities import Capabilities, capabilities
from dtrain.dist.runtime import Runtime
from dtrain.parallel.frozen import checkpoint_options, frozen_names, with_frozen, without
from dtrain.parallel.grad_norm import gradient_norm, local_part
from dtrain.parallel.materialize import is_meta_model, materialize
from dtrain.parallel.recipe import Recipe, model_blocks
from dtrain.parallel.skeleton import meta_copy
from dtrain.parallel.sync_batchnorm import apply_sync_batchnorm
from dtrain.task import Task

LossFn = Callable[[Any, Any], torch.Tensor]


class Strategy(ABC):
    name: ClassVar[str] = ""

    def __init__(
        self,
        runtime: Runtime,
        options: StrategyConfig,
        comm: CommConfig,
        recipe: Recipe,
    ) -> None:
        self.runtime = runtime
        self.options = options  # [strategy]
        self.comm_options = comm  # [comm]
        # What every strategy does to the blocks (activation checkpointing, compile) and the
        # precision every forward runs in; and the seed of a meta-built model's values.
        self.recipe = recipe
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

    @property
    def capabilities(self) -> Capabilities:
        """What this strategy can do, as the config's rules read it."""
        return capabilities(self.name)

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
            seed = self.recipe.seed
            materialize(meta_copy(model), model, task.init_weights, self.runtime.device, seed)
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
    def broadcast_from_first(self, tensors: Iterable[torch.Tensor]) -> None:
        """Every data-parallel rank takes the first one's ``tensors``, in place (counted, the
        wait timed). Collective over the data-parallel group."""
        for tensor in tensors:
            with self.comm.waiting():
                dist.broadcast(tensor, group=self.data_parallel_group, group_src=0)
            self.comm.broadcast(tensor.numel() * tensor.element_size(), self.data_parallel_size)

    def agree_on_buffers(self) -> None:
        """Before an evaluation: every data-parallel rank takes the first one's buffers
        (BatchNorm's running statistics, which each rank updates from its own share unless
        ``strategy.sync_batchnorm``), the ones a checkpoint saves -- so that the evaluation
        is the saved model's. Collective over the data-parallel group. Training does not
        read running statistics, so its math does not change."""
        if self.data_parallel_size > 1 and dist.is_initialized():
            # A DTensor's parts are laid out by its own mesh.
            buffers = self.unwrapped.buffers()
            self.broadcast_from_first(
                b for b in buffers if type(b) is torch.Tensor and not b.is_meta
            )

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

    # How this rank's model and optimizer state lie over the ranks (dtrain.checkpoint.forms),
    # which decides how a checkpoint writes them and reads another form into them.
    state_form: ClassVar[Form] = Form.REPLICATED
    # This rank's parameter names that the whole model gives otherwise (a pipeline stage's copy
    # of a tied parameter -> the parameter's first name), for reading other strategies' state.
    whole_names: Mapping[str, str] = {}

    @property
    def settings_per_name(self) -> bool:
        """Whether its sharded optimizer state keeps its settings per parameter."""
        return False

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> dict[str, Part]:
        """This rank's named state dicts in their forms. Replicated (this default): every rank
        holds the same whole model and optimizer (rank 0's are saved)."""
        return {
            "model": Part(self.state_form, without(self.model_state_dict(), self.left_out)),
            "optimizer": Part(self.state_form, self.optimizer_state_dict(optimizer)),
        }

    def load_state_dicts(self, optimizer: torch.optim.Optimizer, states: dict[str, Any]) -> None:
        """Take ``model`` and ``optimizer`` back in the form :meth:`state_dicts` gives them."""
        self.load_model_state_dict(with_frozen(states["model"], self.unwrapped, self.left_out))
        self.load_optimizer_state_dict(optimizer, states["optimizer"])

    @functools.cached_property
    def left_out(self) -> frozenset[str]:
        """The model's names its checkpoints leave out: a PEFT model's frozen base
        (:mod:`dtrain.parallel.frozen`), else none."""
        return frozen_names(self.unwrapped)

    def state_dicts_by_name(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``model`` and ``optimizer`` in the form any other strategy's state converts through
        (:mod:`dtrain.checkpoint.cross_form`): torch's distributed state-dict default, each
        parameter by its name in the whole model (:attr:`whole_names`); this rank's part of
        each tensor."""
        model_state, optim_state = self._torch_state(optimizer)
        return {"model": model_state, "optimizer": renamed(optim_state, self.whole_names)}

    def load_state_dicts_by_name(
        self, optimizer: torch.optim.Optimizer, states: dict[str, Any]
    ) -> None:
        ours = {whole: name for name, whole in self.whole_names.items()}
        self._set_torch_state(optimizer, states["model"], renamed(states["optimizer"], ours))

    def _torch_state(
        self, optimizer: torch.optim.Optimizer, options: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and optimizer's state through torch's distributed state-dict API
        (``options``: its ``StateDictOptions``, None for its default), frozen names left out."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        opts = checkpoint_options(options, self.left_out)
        model_state, optim_state = get_state_dict(self.unwrapped, optimizer, options=opts)
        return without(model_state, self.left_out), optim_state

    def _set_torch_state(
        self, optimizer: torch.optim.Optimizer, model: Any, optim: Any, options: Any = None
    ) -> None:
        """:meth:`_torch_state`'s inverse, in place."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        opts = checkpoint_options(options, self.left_out)
        set_state_dict(
            self.unwrapped, optimizer, model_state_dict=model, optim_state_dict=optim, options=opts
        )

    def load_beside(self, parts: dict[str, Any], origin: Origin) -> None:
        """Take the parts beside the model and optimizer that :meth:`state_dicts` gives and the
        checkpoint holds (``parts``: those found). Default: none."""
        return None

    def model_state_dict(self) -> dict[str, Any]:
        return self.unwrapped.state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.unwrapped.load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """torch's whole state dict, with each group's parameter names beside it (so that a
        sharded strategy can read it: :mod:`dtrain.checkpoint.cross_form`)."""
        return with_param_names(optimizer.state_dict(), optimizer, self.named_parameters())

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)


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

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> dict[str, Part]:
        parts = super().state_dicts(optimizer)
        hook = self.comm_hook_of_ours
        if hook is not None and hook.stateful:  # every rank: residuals differ between ranks
            state = {"layout": self._comm_layout(hook), "hook": hook.state_dict()}
            parts["comm"] = Part(Form.PER_RANK, state)
        return parts

    def load_beside(self, parts: dict[str, Any], origin: Origin) -> None:
        """Also restore this rank's hook state when it was saved with the same layout: the
        same method, strategy, bucket size and data-parallel size (residuals are kept per
        bucket, and belong to a rank's share of the data, as RNG streams do). Else, or when
        the checkpoint has none (saved without compression), the hook starts afresh."""
        super().load_beside(parts, origin)
        hook = self.comm_hook_of_ours
        if hook is None or not hook.stateful:
            return
        saved = parts.get("comm", {})
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
