"""``allreduce``: data parallel written directly on ``torch.distributed`` -- the reference
implementation to read, beside torch's own DDP (``ddp``), which gives the same training math.

How one step goes::

    setup      broadcast parameters and buffers from rank 0        (replicas start equal)
               buckets = parameters in reverse registration order,  (the order backward
                         cut so that none passes strategy.bucket_mb   produces gradients)
               register_post_accumulate_grad_hook on every parameter
    backward   a parameter's .grad is final -> its hook copies it into its place in the
               bucket buffer, makes .grad that view, and marks it ready;
               a bucket whose parameters are all ready (and every bucket before it launched)
               -> comm hook -> async all_reduce (or a compressed exchange: comm.compression)
               (communication overlaps the rest of the backward pass)
    finish     launch the buckets backward never completed (parameters without a gradient
               this step), wait for every bucket: each .grad, a view of one, is averaged
    no_backward_sync()   the hooks do nothing: accumulation micro-steps stay local

Buckets are launched strictly in index order, whatever order they became ready in: collectives
must be issued in the same order on every rank, and ranks whose data leaves different parameters
without a gradient would otherwise launch them in different orders.

Hooks have torch DDP's shape, ``hook(state, bucket) -> Future[Tensor]`` whose value is the
*averaged* flat gradient, so a hook written for DDP plugs in unchanged; set-up registers the one
``comm.compression`` names, and one registered by hand replaces it (and counts no bytes).
Invariant to keep in mind: from the sync on, a ``.grad`` is a view of its bucket (as DDP's
``gradient_as_bucket_view``), so the next step's sync writes over it. Bucket size, hooks, unused
parameters and the differences from torch DDP: docs/strategies.md, "allreduce"; the waiting
time measured in ``sync_gradients``: docs/communication.md.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.compression import build_comm_hook
from dtrain.comm.hooks import run_comm_hook
from dtrain.parallel.base import BackwardSyncControl, CommHookControl
from dtrain.parallel.grad_sync import MIB, assign_buckets, split_like
from dtrain.task import Task


class GradBucket:
    """What a communication hook sees of one bucket: the interface of
    ``torch.distributed.GradBucket`` over this strategy's flat buffer."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        params: Sequence[nn.Parameter],
        views: Sequence[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._params = list(params)
        self._views = list(views)
        self._is_last = is_last

    def index(self) -> int:
        """Position of the bucket in launch order (0 = the first gradients backward makes)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat, 1-D buffer holding this rank's gradients of the bucket's parameters."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        # Copied in, not rebound, so that the views of gradients() stay views of the buffer.
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        """One view into the buffer per parameter, shaped like that parameter."""
        return list(self._views)

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def is_last(self) -> bool:
        """True for the bucket launched last in a step (hooks use it to count iterations)."""
        return self._is_last


# hook(state, bucket): bucket is a GradBucket here (torch's own in DDP, hence Any).
HookFn = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]


@dataclass(eq=False)
class _Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]  # the buffer seen as one tensor per parameter
    ready: set[int] = field(default_factory=set)  # id() of params whose grad is final
    future: torch.futures.Future[torch.Tensor] | None = None


class AllReduceStrategy(CommHookControl, BackwardSyncControl):
    """Hand-written data parallel: bucketed, overlapped all-reduce of gradients."""

    name = "allreduce"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Set-up registers the hook comm.compression names (dtrain.comm), which counts its
        # bytes; a hook registered by hand (register_comm_hook) replaces it. Only a rank with
        # buckets (set up, world > 1) launches one.
        self.comm_hook: HookFn
        self._last_launch = 0.0  # time.perf_counter() when the latest bucket was launched
        self.buckets: list[_Bucket] = []
        self.launches = 0  # bucket communications started since set-up (tests count them)
        self._sync = True  # False inside no_backward_sync()
        self._next = 0  # the next bucket to launch; buckets go out strictly in index order

    # -- set-up --------------------------------------------------------------------------

    def setup(self, task: Task) -> None:
        self.module = self.model = self.build_replica(task)
        if self.runtime.world_size == 1:
            return  # nothing to average: plain local training
        # Replicas must start equal; after that equal averaged gradients keep them equal.
        self.broadcast_from_first([*self.module.parameters(), *self.module.buffers()])
        # parameters() yields a shared (tied) parameter once, so it gets one hook and one slot;
        # autograd sums all its uses into .grad before that hook fires.
        params = [p for p in self.module.parameters() if p.requires_grad]
        # Reverse registration order approximates the order backward finishes gradients in,
        # so that the first buckets fill (and start communicating) early in backward.
        params.reverse()
        cap = max(1, int(self.options.bucket_mb * MIB))
        # Every bucket, the first too, bounded by bucket_mb as ddp's (see the module docstring).
        for members in assign_buckets(params, cap):
            self._add_bucket([params[i] for i in members])
        hook = build_comm_hook(
            self.comm_options,
            self.runtime.timeout,
            self.comm,
            self.data_parallel_group,
            self.runtime.device,
            capacity=max((b.buffer.nbytes for b in self.buckets), default=0),
        )
        self.register_comm_hook(hook, run_comm_hook)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        views = list(split_like(buffer, params))
        bucket = _Bucket(index=len(self.buckets), params=params, buffer=buffer, views=views)
        self.buckets.append(bucket)
        for param, view in zip(params, views):
            hook = functools.partial(self._grad_ready, bucket, view)
            param.register_post_accumulate_grad_hook(hook)

    def register_comm_hook(self, state: Any, hook: HookFn) -> None:
        """Use ``hook(state, bucket)`` instead of the plain averaging all-reduce; the same
        contract as ``DistributedDataParallel.register_comm_hook``. Call it before the first
        step (before or after set-up)."""
        if not callable(hook):
            raise TypeError(f"comm hook must be callable as hook(state, bucket), got {hook!r}")
        if self.launches:
            raise RuntimeError("register_comm_hook() must be called before the first step")
        self.comm_state, self.comm_hook = state, hook

    # -- accumulation --------------------------------------------------------------------

    @contextlib.contextmanager
    def no_backward_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    # -- the step ------------------------------------------------------------------------

    def _grad_ready(self, bucket: _Bucket, view: torch.Tensor, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``param.grad`` holds its final value for this backward."""
        if not self._sync:
            return  # an accumulation micro-step: the gradient stays local
        if id(param) in bucket.ready or bucket.future is not None:
            raise RuntimeError(
                "allreduce: a parameter received a second gradient after its bucket was "
                "reduced in this step; run one backward per synchronized step and put "
                "accumulation micro-steps inside no_backward_sync()"
            )
        # Now, as DDP does, not at launch: backward frees its gradient at once, and when it
        # ends only the last gradient is left to copy before the last bucket goes out.
        _into_bucket(param, view)
        bucket.ready.add(id(param))
        # Launch every bucket that is complete, in order, up to the first incomplete one.
        while self._next < len(self.buckets):
            head = self.buckets[self._next]
            if len(head.ready) < len(head.params):
                break
            self._launch(head)

    def _launch(self, bucket: _Bucket) -> None:
        # The parameters whose hook did not fire in this backward: no gradient on this rank,
        # or one left from an accumulation micro-step.
        for param, view in zip(bucket.params, bucket.views):
            if id(param) not in bucket.ready:
                _into_bucket(param, view)
        last = bucket.index == len(self.buckets) - 1
        handle = GradBucket(bucket.index, bucket.buffer, bucket.params, bucket.views, last)
        self._last_launch = time.perf_counter()
        bucket.future = self.comm_hook(self.comm_state, handle)
        self.launches += 1
        self._next = bucket.index + 1

    def sync_gradients(self) -> None:
        """Complete the step's gradient sync: launch what backward did not and wait for every
        bucket, which every ``.grad`` is a view of. After it, gradients are equal on every
        rank. (``sync_gradients``; a hand-written loop calls it after the last backward of a
        step.)"""
        if not self.buckets:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        # After every bucket: each rank has then issued the same collectives in the same order.
        used = self._globally_used() if self.options.find_unused_parameters else None
        results = []
        for bucket in self.buckets:
            assert bucket.future is not None
            results.append(bucket.future.wait())
        # Waiting on communication: from the last bucket's launch (backward's computation had
        # ended) until every bucket is reduced; a hook's result copied in is not counted.
        self.comm.waited(time.perf_counter() - self._last_launch)
        slot = 0
        for bucket, averaged in zip(self.buckets, results):
            if averaged.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(averaged)  # a hook that gives its mean in a tensor of its own
            # Every .grad the bucket took in is its view, now averaged; the rest (no gradient
            # on this rank) get theirs.
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is None and (used is None or used[slot]):
                    param.grad = view  # (no rank produced one: left at None, as one process)
                slot += 1
            bucket.ready.clear()
            bucket.future = None
        self._next = 0

    def _globally_used(self) -> list[bool]:
        """For each parameter (in bucket order), whether any rank has a gradient for it."""
        params = [p for bucket in self.buckets for p in bucket.params]
        flags = torch.tensor(
            [p.grad is not None for p in params], dtype=torch.int32, device=self.runtime.device
        )
        dist.all_reduce(flags, group=self.data_parallel_group)
        self.comm.all_reduce(flags.numel() * flags.element_size(), self.data_parallel_size)
        return [bool(flag) for flag in flags.tolist()]


def _into_bucket(param: torch.Tensor, view: torch.Tensor) -> None:
    """``param``'s gradient into ``view``, its place in a bucket (zeros where this rank has none),
    and ``.grad`` made that view (DDP's ``gradient_as_bucket_view``): the averaged bucket needs no
    copy back, and a ``.grad`` kept between steps accumulates in the bucket itself."""
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad.is_sparse:
        raise RuntimeError(
            "allreduce: sparse gradients are not supported (an Embedding with "
            "sparse=True?); use dense gradients or strategy.name = 'ddp'"
        )
    elif grad is not view:
        view.copy_(grad)
        param.grad = view
