"""``ddp``: torch's DistributedDataParallel, with gradient sync skipped on accumulation
micro-steps through its ``no_sync`` context.

Gradients go through a comm hook of ours even without compression (``'none'`` is
:class:`~dtrain.comm.hooks.MeanHook`), so that every bucket's bytes and wait are counted, at no
measurable cost (docs/communication.md, "``ddp`` without compression"). DDP's other collectives
are counted from their sizes: set-up's broadcast, the buffers before every forward that syncs
them, and with ``strategy.find_unused_parameters`` the used-parameter map (one int32 per
parameter) in every synchronized backward.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.comm.compression import build_comm_hook
from dtrain.comm.hooks import CommHook, run_comm_hook
from dtrain.compute.model_call import call_model
from dtrain.parallel.base import (
    BackwardSyncControl,
    CommHookControl,
    LossFn,
)
from dtrain.task import Task


class DDPStrategy(CommHookControl, BackwardSyncControl):
    """torch DistributedDataParallel: replicated model, bucketed all-reduce in backward"""

    name = "ddp"

    # The comm hook, as DDP takes it: hook(state, bucket) (and comm_state). Set-up builds the
    # one comm.compression names; register_comm_hook replaces it. DDP takes one hook, once: it
    # is registered before the first step.
    comm_hook: Any = None
    _hook_registered = False

    def setup(self, task: Task) -> None:
        self.module = self.build_replica(task)
        if self.runtime.world_size > 1:
            device_ids = [self.runtime.device.index] if self.runtime.device.type == "cuda" else None
            self.model = DistributedDataParallel(
                self.module,
                device_ids=device_ids,
                bucket_cap_mb=self.options.bucket_mb,
                find_unused_parameters=self.options.find_unused_parameters,
                # Gradients live in the buckets the all-reduce works on, instead of being copied
                # in before it and out after: one gradient-sized buffer and two copies less.
                gradient_as_bucket_view=True,
            )
            # DDP's constructor broadcast rank 0's parameters and buffers.
            self.comm.broadcast(_state_bytes(self.module), self.data_parallel_size)
            if self.model.broadcast_buffers and self.model.modules_buffers:
                # Counts the buffers DDP broadcasts before a training forward. A module
                # without buffers has none to count, and a forward hook costs every step
                # (a Python call where torch otherwise takes its hook-free path).
                self.model.register_forward_pre_hook(self._count_buffer_sync)
            self.comm_state = build_comm_hook(
                self.comm_options,
                self.runtime.timeout,
                self.comm,
                self.data_parallel_group,
                self.runtime.device,
                capacity=_largest_bucket_bound(self.module),
            )
            self.comm_hook = run_comm_hook
        else:
            self.model = self.module

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Use ``hook(state, bucket)`` (a DDP comm hook) instead of the one
        ``comm.compression`` names; before the first step. Its bytes are not counted unless
        it counts them itself."""
        if self._hook_registered:
            raise RuntimeError("register_comm_hook() must be called before the first step")
        self.comm_state, self.comm_hook = state, hook

    def _count_buffer_sync(self, model: nn.Module, inputs: Any) -> None:
        # Runs just before DDP's forward, which broadcasts the buffers from rank 0 when this
        # says so (in training, with broadcast_buffers, when there are any).
        assert isinstance(model, DistributedDataParallel)
        if torch.is_grad_enabled() and model.will_sync_module_buffers():
            size = sum(b.numel() * b.element_size() for b in model.modules_buffers)
            self.comm.broadcast(size, self.data_parallel_size)

    def no_backward_sync(self) -> contextlib.AbstractContextManager[None]:
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def before_first_step(self, micro_batch: tuple[Any, Any], loss_fn: LossFn) -> None:
        self._hook_registered = True
        if isinstance(self.model, DistributedDataParallel) and self.comm_hook is not None:
            if getattr(self.model, "_comm_hooks", None):
                # One registered on the DDP module itself: DDP takes no second; it stays.
                self.comm_state = self.comm_hook = None
            else:
                self.model.register_comm_hook(self.comm_state, self.comm_hook)
        self._warm_up(micro_batch, loss_fn)

    def sync_gradients(self) -> None:
        """After a step's synchronized backward: count the time waited on its buckets, and the
        used-parameter map's all-reduce."""
        if not isinstance(self.model, DistributedDataParallel):
            return
        hook = self.comm_state
        if isinstance(hook, CommHook) and hook.last_launch is not None:
            # From the last bucket's hook call (backward's computation had ended) until
            # backward returned: DDP waits for every bucket, then copies them into .grad.
            self.comm.waited(time.perf_counter() - hook.last_launch)
            hook.last_launch = None
        if self.options.find_unused_parameters:
            flags = sum(1 for p in self.unwrapped.parameters() if p.requires_grad)
            self.comm.all_reduce(4 * flags, self.data_parallel_size)  # int32 each

    def _warm_up(self, micro_batch: tuple[Any, Any], loss_fn: LossFn) -> None:
        """One throwaway synced backward before the first real step of this process.

        DDP sums the first backward in one bucket of every gradient, then rebuilds its buckets
        in the order the gradients became ready. Where an element sits in a bucket decides the
        order in which the ranks' values are added, and with 3 or more ranks that order shows
        in the last bits. Without this pass, the first step after a resume (a new DDP) would
        be summed in another layout than the same step of the uninterrupted run, and the
        resumed run would not be bit-identical to it. Eval mode and a zero scale: no dropout
        draws, no BatchNorm statistics, no gradient left behind.

        A hook with state kept per bucket (error feedback of powersgd, topk) needs the final
        buckets from its first step on, in every run, so it gets this pass at any world size.
        Our hooks send nothing in it. (With ``find_unused_parameters`` DDP never rebuilds.)
        """
        if (
            not isinstance(self.model, DistributedDataParallel)
            or self.options.find_unused_parameters
        ):
            return
        hook = self.comm_hook_of_ours
        if self.runtime.world_size < 3 and not (hook is not None and hook.stateful):
            return  # a sum of two values does not depend on their order
        assert self.module is not None
        inputs, targets = micro_batch
        was_training = self.module.training
        self.module.eval()
        local = hook.local_only() if hook is not None else contextlib.nullcontext()
        try:
            with local:
                with self.recipe.precision.autocast():
                    loss_sum = loss_fn(call_model(self.model, inputs), targets).sum()
                (loss_sum * 0.0).backward()
        finally:
            self.module.train(was_training)
            for param in self.module.parameters():
                param.grad = None


def _largest_bucket_bound(module: nn.Module) -> int:
    """At least the bytes of DDP's largest gradient bucket: all the gradients of a dtype."""
    sizes: dict[torch.dtype, int] = {}
    for param in module.parameters():
        if param.requires_grad:
            sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel() * param.element_size()
    return max(sizes.values(), default=0)


def _state_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (a shared tensor once)."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
