"""The strategy interface: how a model is spread over ranks, and nothing else.

The trainer talks to a strategy only through :class:`Strategy`; it never asks which one it has.
A strategy owns the wrapped model, runs forward and backward over one step's micro-batches
(leaving gradients synchronized and normalized), and moves the model's state in and out of
checkpoints (:meth:`Strategy.checkpoint_parts`: whole files from rank 0 here; shards from every
rank in :class:`~dtrain.parallel.sharded.ShardedStrategy`). Abilities that only some strategies
have are separate, explicit capabilities (:class:`BackwardSyncControl` for skipping gradient
sync on accumulation micro-steps), in the manner of Lightning Fabric's ``_BackwardSyncControl``.

A subclass sets ``name`` (what ``strategy.name`` says); the registry that looks names up is the
package's ``__init__`` (``build_strategy``), which imports the strategy a run uses: this module
imports none of them.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.read import check_model_fits
from dtrain.checkpoint.state import CheckpointParts
from dtrain.comm.accounting import CommCounter
from dtrain.comm.compression import validate_compression
from dtrain.comm.hooks import CommHook
from dtrain.config import Config, validate_for_world
from dtrain.errors import CheckpointError, ConfigError
from dtrain.optim import fit_saved_groups
from dtrain.parallel.grad_norm import gradient_norm, local_part
from dtrain.runtime import Runtime
from dtrain.task import Task

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed per-item loss over the step (detached)


class BackwardSyncControl(ABC):
    """Capability: run a backward pass without synchronizing gradients."""

    @abstractmethod
    def no_backward_sync(self) -> contextlib.AbstractContextManager[None]: ...


class Strategy(ABC):
    name: ClassVar[str] = ""
    # Whether gradients go through comm hooks that comm.compression can replace (ddp,
    # allreduce); any other strategy rejects compression in validate_config.
    takes_compression: ClassVar[bool] = False
    # Whether ranks may hold different shares of a global batch and run different numbers of
    # micro-steps (balance.mode = 'throughput'): true where gradients meet once per step, on
    # each rank's last micro-batch, and nothing else in a step is collective (ddp, allreduce).
    takes_load_balancing: ClassVar[bool] = False
    # Whether ``comm`` counts every byte this strategy sends. Strategies whose collectives run
    # inside torch (FSDP's gathers, pipeline sends, tensor-parallel all-reduces) count only
    # dtrain's own, so their totals are left out of the metrics rather than understated.
    counts_all_traffic: ClassVar[bool] = True

    def __init__(self, cfg: Config, runtime: Runtime) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.module: nn.Module | None = None  # the user's model, unwrapped
        self.model: nn.Module | None = None  # what forward runs through
        # Bytes this rank sends and time it waits on communication (dtrain.comm.accounting):
        # every collective a strategy issues is counted here.
        self.comm = CommCounter()
        self._norm_params: list[nn.Parameter] | None = None  # clip_grad_norm's, once

    @classmethod
    def validate_config(cls, cfg: Config, world_size: int) -> None:
        """Reject, in the parent process, a config this strategy cannot run at this world
        size. Data parallel by default: every rank is a data-parallel rank. (A strategy with
        another mesh dimension calls this with its data-parallel size.) Compression is
        rejected here for every strategy that does not take it."""
        validate_for_world(cfg, world_size)
        if cfg.comm.compression != "none" and not cls.takes_compression:
            raise ConfigError(
                f"comm.compression = {cfg.comm.compression!r} does not work with "
                f"strategy.name = {cls.name!r}: it takes comm.compression = 'none' only "
                "(gradient compression needs a strategy that all-reduces whole gradients "
                "through comm hooks: ddp or allreduce)"
            )
        if cfg.comm.transport == "shm" and not cls.takes_compression:
            raise ConfigError(
                f"comm.transport = 'shm' does not work with strategy.name = {cls.name!r}: it "
                "carries the gradient all-reduce of ddp and allreduce only; use "
                "comm.transport = 'auto'"
            )
        if cls.takes_compression:
            validate_compression(cfg)
        if cfg.balance.mode != "off" and not cls.takes_load_balancing:
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

    # -- set-up --------------------------------------------------------------------------

    @abstractmethod
    def setup(self, task: Task) -> None:
        """Move the model to the device and wrap it; sets ``module`` and ``model``."""

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this rank's optimizer updates."""
        assert self.model is not None
        return self.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        assert self.model is not None
        return self.unwrapped.named_parameters()

    @property
    def unwrapped(self) -> nn.Module:
        assert self.module is not None, "setup() has not run"
        return self.module

    # -- the step ------------------------------------------------------------------------

    @abstractmethod
    def forward_backward(
        self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, scale: torch.Tensor
    ) -> StepResult:
        """Forward and backward over one step's micro-batches of ``(inputs, targets)``.

        Each micro-batch's summed loss is multiplied by ``scale`` before backward; the trainer
        sets it to ``data_parallel_size / global_item_count`` so that after the (averaging)
        gradient sync every rank holds the gradient of the global mean loss."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm (0 = only measure it); returns the norm."""
        if self._norm_params is None:
            # The parameters are the same objects for the whole run (a rollback loads values
            # into them): walking the module tree costs ~8 µs a step even for a 4-layer MLP.
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

    def agree_on_step(self, items: int, stop: bool) -> tuple[int, bool]:
        """In one collective, what every rank must agree on before a step: the global item
        count (each item counted once) and whether any rank was asked to stop. Data parallel:
        one all-reduce over the data-parallel group, which is every rank. (A pipeline's
        stages hold the same items and are not in one data-parallel group: it overrides.)"""
        agreed = torch.tensor([items, float(stop)], dtype=torch.float64, device=self.runtime.device)
        self.all_reduce_sum(agreed)
        return int(agreed[0]), bool(agreed[1] > 0)

    def model_for_inference(self) -> nn.Module | None:
        """The model to run the task's after-training hook with on this rank, or None when
        this rank does not run it. Collective: every rank calls it. Default: the unwrapped
        model on rank 0."""
        return self.unwrapped if self.runtime.is_main else None

    @torch.no_grad()
    def eval_loss(self, batch: tuple[Any, Any], loss_fn: LossFn) -> torch.Tensor:
        """Summed loss of one evaluation batch on this rank (no gradient sync involved)."""
        inputs, targets = batch
        module = self.unwrapped
        return loss_fn(module(inputs), targets).sum()

    # -- state ---------------------------------------------------------------------------

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> CheckpointParts:
        """What this rank writes of the model and optimizer into a checkpoint. Replicated (this
        default): every rank holds the same, so rank 0 writes both whole, as ``model.pt`` and
        ``optimizer.pt``. (:class:`~dtrain.parallel.sharded.ShardedStrategy` overrides.)"""
        parts = CheckpointParts()
        if self.runtime.is_main:
            parts.files[layout.MODEL_FILE] = self.model_state_dict()
            parts.files[layout.OPTIMIZER_FILE] = self.optimizer_state_dict(optimizer)
        hook = self.stateful_comm_hook()
        if hook is not None:  # every rank: the residuals differ from rank to rank
            parts.files[layout.comm_file(self.data_parallel_rank)] = {
                "layout": self._comm_layout(hook),
                "hook": hook.state_dict(),
            }
        return parts

    def load_checkpoint_parts(self, optimizer: torch.optim.Optimizer, step_dir: Path) -> None:
        """Load the model and optimizer from what :meth:`checkpoint_parts` wrote into
        ``step_dir``; a model that does not fit is named key by key."""
        if not (step_dir / layout.MODEL_FILE).exists():
            raise CheckpointError(
                f"{step_dir} holds a sharded checkpoint (made by a sharded strategy such as "
                f"fsdp); strategy {self.name!r} loads full-state checkpoints: resume it with "
                "the strategy that saved it"
            )
        model_state = ckread.load_file(step_dir, layout.MODEL_FILE)
        check_model_fits(self.model_state_dict(), model_state, step_dir)
        self.load_model_state_dict(model_state)
        self.load_optimizer_state_dict(optimizer, ckread.load_file(step_dir, layout.OPTIMIZER_FILE))
        self.load_comm_hook_state(step_dir)

    def stateful_comm_hook(self) -> CommHook | None:
        """The communication hook whose training state (error-feedback residuals, ...) a
        checkpoint holds, one ``comm-rankNNNNN.pt`` per rank; None when there is none."""
        return None

    def load_comm_hook_state(self, step_dir: Path) -> None:
        """Restore this rank's hook state from ``step_dir`` when it was saved with the same
        layout: the same method, strategy, bucket size and data-parallel size (residuals are
        kept per bucket, and belong to a rank's share of the data, as RNG streams do). Else,
        or when the checkpoint has none (saved without compression), the hook starts afresh."""
        hook = self.stateful_comm_hook()
        if hook is None:
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
            "bucket_mb": self.cfg.strategy.bucket_mb,
            "data_parallel_size": self.data_parallel_size,
        }

    def model_state_dict(self) -> dict[str, Any]:
        return self.unwrapped.state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.unwrapped.load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(fit_saved_groups(state, optimizer))

    @property
    def replicated_state(self) -> bool:
        """True when every rank holds the whole model and optimizer state (rank 0 saves it)."""
        return True

    @property
    def lockstep_eval(self) -> bool:
        """True when every rank must run the same number of forward passes (collectives in
        forward: FSDP's all-gathers, pipeline sends); evaluation then pads with batches that
        are computed and not counted."""
        return False

    def parameter_bytes(self) -> int:
        """Bytes of parameters this rank holds (of a sharded parameter, its local part)."""
        return sum(local_part(p).numel() * p.element_size() for p in self.parameters())


class LossScale:
    """The trainer's loss scale (``data_parallel_size / global items``) as a float32 tensor on
    the training device; the last one again while the value stays, as on every step of
    fixed-length data. A new tensor from a Python float took ~20 µs of a 3 ms CPU step, and is a
    host-to-device copy on a GPU; strategies only read it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last: tuple[float, torch.Tensor] | None = None

    def __call__(self, value: float) -> torch.Tensor:
        if self._last is None or self._last[0] != value:
            self._last = (value, torch.tensor(value, dtype=torch.float32, device=self.device))
        return self._last[1]


def run_micro_batches(
    strategy: Strategy,
    micro_batches: Sequence[tuple[Any, Any]],
    loss_fn: LossFn,
    scale: torch.Tensor,
) -> StepResult:
    """Forward and backward over the step's micro-batches, one after the other; returns the
    summed loss. A strategy with :class:`BackwardSyncControl` syncs gradients on the last
    micro-batch only."""
    assert strategy.model is not None
    total: torch.Tensor | None = None
    last = len(micro_batches) - 1
    for index, (inputs, targets) in enumerate(micro_batches):
        ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if index < last and isinstance(strategy, BackwardSyncControl):
            ctx = strategy.no_backward_sync()
        with ctx:
            loss_sum = loss_fn(strategy.model(inputs), targets).sum()
            # The gradient of ``loss_sum * scale``, bit for bit (the product's backward would
            # pass on 1.0 x scale), without the product and its backward node.
            loss_sum.backward(scale if scale.dtype == loss_sum.dtype else scale.to(loss_sum.dtype))
        total = loss_sum.detach() if total is None else total + loss_sum.detach()
    assert total is not None, "a step has at least one micro-batch"
    return StepResult(loss_sum=total)
