"""Gradient communication hooks: what a data-parallel strategy does with one bucket of gradients.

A hook has torch DDP's shape, ``hook(state, bucket) -> Future[Tensor]`` (the bucket averaged),
so one hook serves ``DistributedDataParallel`` and ``allreduce`` alike (docs/communication.md).
The function registered is always :func:`run_comm_hook`; its state is a :class:`CommHook`, which
does the work, counts every byte it hands to a collective, and holds the method's training state
(error-feedback residuals) for checkpoints.

This module leaves out ``from __future__ import annotations`` on purpose: DDP's
``register_comm_hook`` reads the hook's annotations as objects and accepts only torch's own
``dist.GradBucket`` there (a string annotation is refused).
"""

import contextlib
import time
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from dtrain.comm.accounting import CommCounter
from dtrain.comm.agreement import MAX_CARRYING_RANKS, StepAgreement
from dtrain.comm.mean import divide_, divide_into
from dtrain.comm.transport import SumTransport


class Bucket(Protocol):
    """What a hook uses of a bucket: ``torch.distributed.GradBucket`` in DDP,
    :class:`dtrain.parallel.allreduce.GradBucket` in the ``allreduce`` strategy."""

    def index(self) -> int: ...

    def buffer(self) -> torch.Tensor: ...

    def gradients(self) -> list[torch.Tensor]: ...

    def is_last(self) -> bool: ...


class CommHook:
    """A hook's state and work: :meth:`reduce` one bucket, counting what it sends.

    ``stateful`` hooks keep training state from step to step (error feedback); a strategy
    saves it per rank in checkpoints, since it differs from rank to rank.
    """

    name: ClassVar[str] = ""
    stateful: ClassVar[bool] = False
    # Whether its collectives are all summing all-reduces, which an opt-in transport can carry
    # (comm.transport; dtrain.comm.transport).
    sums_only: ClassVar[bool] = False
    # Whether it sums the step's agreement with its last bucket (see carry).
    carries_agreement: ClassVar[bool] = False

    def __init__(
        self, counter: CommCounter, group: dist.ProcessGroup | None, device: torch.device
    ) -> None:
        self.counter = counter
        self.group = group
        self.device = device
        self.world_size = dist.get_world_size(group)
        # time.perf_counter() when the latest bucket was handed to this hook; the strategy
        # measures the time waiting on communication from there (dtrain.comm.accounting).
        self.last_launch: float | None = None
        self._local = False
        # Set by build_comm_hook where comm.transport names an opt-in transport for the sums.
        self.transport: SumTransport | None = None
        self._last_bucket = False  # whether the bucket being reduced is the step's last
        self._carried: StepAgreement | None = None  # to sum with this step's last bucket
        self._staging: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def launch(self, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        if self._local:
            return _done(bucket.buffer())
        self.last_launch = time.perf_counter()
        self._last_bucket = bucket.is_last()
        return self.reduce(bucket)

    def reduce(self, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        """Start averaging ``bucket`` over the group; the future's value is the mean, shaped
        like ``bucket.buffer()``."""
        raise NotImplementedError

    def carry(self, agreement: StepAgreement) -> None:
        """Sum ``agreement`` over the group with this step's last bucket, if this hook can
        (``carries_agreement``, a float32 or float64 bucket, a group of at most
        ``MAX_CARRYING_RANKS``); ``agreement.agreed`` says afterwards whether it did."""
        if self.carries_agreement:
            self._carried = agreement

    def _take_carried(self, bucket: Bucket) -> StepAgreement | None:
        """The agreement to sum with ``bucket``: only the step's last, and only once."""
        if not bucket.is_last():
            return None
        carried, self._carried = self._carried, None
        fits = bucket.buffer().dtype in (torch.float32, torch.float64)
        return carried if fits and self.world_size <= MAX_CARRYING_RANKS else None

    @contextlib.contextmanager
    def local_only(self) -> Iterator[None]:
        """Inside, buckets are returned as they are: no communication, no state change, no
        bytes counted (for a throwaway backward that only makes DDP build its buckets)."""
        self._local = True
        try:
            yield
        finally:
            self._local = False

    def state_dict(self) -> dict[str, Any]:
        """This rank's training state held by the hook: tensors and plain data only."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def reset(self) -> None:
        """Back to the state of a fresh start."""

    def sum_future(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Sum ``tensor`` over the group in place: through the opt-in transport (done when
        this returns) or the process group (started); the future's value is ``tensor``."""
        if self.transport is not None:
            return self._transport_sum(tensor, divisor=1)
        self.counter.all_reduce(tensor.nbytes, self.world_size)
        return all_reduce_future(tensor, self.group)

    def mean_future(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """:meth:`sum_future` of ``tensor`` divided by the group size (before the sum, which
        keeps it in range, as torch's ``allreduce_hook`` does). Through an opt-in transport
        the division is the transport's, in a pass of its own or in its copy of the tensor."""
        if self.transport is not None:
            return self._transport_sum(tensor, divisor=self.world_size)
        return self.sum_future(divide_(tensor, self.world_size))

    def _transport_sum(
        self, tensor: torch.Tensor, divisor: int
    ) -> torch.futures.Future[torch.Tensor]:
        assert self.transport is not None
        self.counter.sent(self.transport.bytes_sent(tensor.nbytes), self.world_size)
        started = time.perf_counter()
        self.transport.all_reduce_(tensor, divisor=divisor)
        if not self._last_bucket:
            # Done before this returns, in the middle of backward: time that no computation
            # hides. (The strategy counts the last bucket's from its launch.)
            self.counter.waited(time.perf_counter() - started)
        return _done(tensor)

    def sum_future_as(
        self, tensor: torch.Tensor, dtype: torch.dtype
    ) -> torch.futures.Future[torch.Tensor]:
        """:meth:`sum_future`, the tensor sent in ``dtype`` (cast, summed, cast back into
        ``tensor``); the future's value is ``tensor``."""
        if tensor.dtype == dtype:
            return self.sum_future(tensor)

        def widen(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            return tensor.copy_(fut.value())

        return self.sum_future(tensor.to(dtype)).then(widen)

    def _to_device(self, tensors: dict[Any, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {int(key): value.to(self.device) for key, value in tensors.items()}


def run_comm_hook(state: CommHook, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The function registered as the communication hook; ``state`` does the work."""
    return state.launch(bucket)


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


def all_reduce_future(
    tensor: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.futures.Future[torch.Tensor]:
    """Start a summing all-reduce of ``tensor`` in place; the future's value is ``tensor``.

    Issued on the process group itself, without ``dist.all_reduce``'s Python checks and
    logging wrappers, which every bucket of every step would pay. The group is one this rank
    belongs to (the strategy's data-parallel group)."""
    process_group = group if group is not None else dist.group.WORLD
    assert process_group is not None, "the default process group is not initialized"
    return process_group.allreduce([tensor]).get_future().then(_first_value)


def _first_value(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return future.value()[0]


class MeanHook(CommHook):
    """No compression: the mean by one all-reduce of the bucket (torch's ``allreduce_hook``,
    counted). Dividing *before* summing keeps the sum in range, as torch does.

    The step's agreement (item count, stop flag) rides in the last bucket's all-reduce: the
    bucket, divided, and the agreement's packed values go into one staging buffer, summed at
    once, and copied back -- a copy of one bucket instead of a collective of its own."""

    name = "none"
    sums_only = True
    carries_agreement = True

    def reduce(self, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        carried = self._take_carried(bucket)
        if carried is None:
            return self.mean_future(bucket.buffer())
        buffer = bucket.buffer()
        n = buffer.numel()
        key = (n + carried.width, buffer.dtype, buffer.device)
        if key not in self._staging:
            self._staging[key] = buffer.new_empty(n + carried.width)
        # staging: (bucket numel + width,) = the bucket's share of the mean, then the packed
        # agreement (exact integers: summed, never divided).
        staging = self._staging[key]
        divide_into(buffer, self.world_size, out=staging[:n])
        staging[n:].copy_(torch.tensor(carried.pack(), dtype=buffer.dtype))

        def unpack(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            summed = fut.value()
            carried.unpack(summed[n:].tolist())
            return buffer.copy_(summed[:n])

        return self.sum_future(staging).then(unpack)


class CastHook(CommHook):
    """Send the bucket in a 16-bit format: divide by the group size (in the bucket's own
    precision, so that the sum stays in range), cast, all-reduce, cast back. Half the bytes
    of fp32; each element of the mean is off by at most about 2 u x the mean of the ranks'
    magnitudes with 2 ranks (u = 2^-11 for fp16, 2^-8 for bf16: the casts and the sum each
    round once)."""

    dtype: ClassVar[torch.dtype]
    sums_only = True

    def reduce(self, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        return self.sum_future_as(divide_(bucket.buffer(), self.world_size), self.dtype)


class Fp16Hook(CastHook):
    """fp16: 10 significant bits, range to 65504 (small gradients may underflow)."""

    name = "fp16"
    dtype = torch.float16


class Bf16Hook(CastHook):
    """bf16: 7 significant bits, the range of fp32. Our own: torch's ``bf16_compress_hook``
    refuses to register without NCCL."""

    name = "bf16"
    dtype = torch.bfloat16
