"""Top-k sparsification with error feedback (Stich et al., 2018; Lin et al., 2018).

Per bucket, each rank adds the residual it kept from earlier steps to its gradient, picks the
k = ceil(fraction x numel) entries of largest magnitude and sends only those: their values
and their positions, all-gathered (values in the bucket's dtype, positions as int32, or int64
for a bucket of 2^31 entries or more). Every rank then sums what every rank sent, in rank
order (so all ranks hold the same bits), and divides by the group size. What a rank did not
send stays in its residual for the next step, so no part of any gradient is lost, only
delayed: the sum of the applied updates tracks the sum of the true gradients.

State: one residual per bucket, on each rank (they differ): checkpointed per rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from dtrain.comm.accounting import CommCounter
from dtrain.comm.hooks import Bucket, CommHook
from dtrain.comm.mean import divide_

INT32_LIMIT = 2**31 - 1


def topk_count(fraction: float, numel: int) -> int:
    """Entries sent of a bucket of ``numel``: ceil(fraction x numel), at least 1."""
    return max(1, min(numel, math.ceil(fraction * numel)))


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= INT32_LIMIT else torch.int64


class TopKHook(CommHook):
    name = "topk"
    stateful = True

    def __init__(
        self,
        counter: CommCounter,
        group: dist.ProcessGroup | None,
        device: torch.device,
        fraction: float,
        error_feedback: bool = True,
    ) -> None:
        super().__init__(counter, group, device)
        if not 0 < fraction <= 1:
            raise ValueError(f"topk fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.error_feedback = error_feedback
        self.residuals: dict[int, torch.Tensor] = {}  # bucket index -> what was not sent yet

    def reduce(self, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()  # (numel,): this rank's gradients, flat
        index, numel = bucket.index(), buffer.numel()
        residual = self.residuals.get(index)
        if residual is not None:
            if residual.numel() != numel:
                raise RuntimeError(
                    f"topk: bucket {index} has {numel} gradient entries but its residual has "
                    f"{residual.numel()}: the buckets changed since that state was saved "
                    "(strategy.bucket_mb or the model); resume with the same ones"
                )
            buffer.add_(residual)
        k = topk_count(self.fraction, numel)
        _, positions = buffer.abs().topk(k, sorted=False)  # (k,)
        values = buffer[positions]  # (k,), a copy
        if self.error_feedback:
            buffer[positions] = 0
            self.residuals[index] = buffer.clone()
        # One message per rank: k values, then k positions, as bytes.
        message = torch.cat(
            [values.view(torch.uint8), positions.to(index_dtype(numel)).view(torch.uint8)]
        )
        gathered = [torch.empty_like(message) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, message, group=self.group, async_op=True)
        assert work is not None
        self.counter.all_gather(message.numel(), self.world_size)
        value_bytes = k * values.element_size()

        def decode(_: torch.futures.Future[Any]) -> torch.Tensor:
            buffer.zero_()
            for part in gathered:  # rank order: the same sum, bit for bit, on every rank
                sent = part[:value_bytes].view(buffer.dtype)
                where = part[value_bytes:].view(index_dtype(numel))
                buffer.index_add_(0, where, sent)
            return divide_(buffer, self.world_size)

        return work.get_future().then(decode)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = self._to_device(state["residuals"])

    def reset(self) -> None:
        self.residuals = {}
