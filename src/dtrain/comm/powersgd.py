"""PowerSGD (Vogels et al., 2019): torch's ``powerSGD_hook``, counted and checkpointable.

Each gradient matrix M (a tensor viewed as ``shape[0]`` rows) is sent as two thin factors
P = M Q (n x r) and Q = M^T P (m x r), all-reduced one after the other; tensors where that
saves less than half (``(n + m) r x 2 >= n m``: biases, norms) go uncompressed in a third
all-reduce. Error feedback keeps what the approximation missed and adds it to the next step's
gradient; warm start reuses last step's Q. The first ``start_step`` steps are plain all-reduce.

Bytes are what torch's hook really sends: its state counts the elements it puts on the wire
(``total_numel_after_compression``: P + Q + the uncompressed tensors); P and Q are the sizes of
its P and Q memories.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)

from dtrain.comm.accounting import CommCounter
from dtrain.comm.hooks import Bucket, CommHook, nbytes
from dtrain.config import CommConfig

# torch's PowerSGDState refuses fewer: with error feedback or warm start it needs plain
# all-reduce steps before the first compressed one (DDP rebuilds its buckets after step 1).
MIN_START_STEP = 2


class PowerSGDHook(CommHook):
    name = "powersgd"
    stateful = True

    def __init__(
        self,
        counter: CommCounter,
        group: dist.ProcessGroup | None,
        device: torch.device,
        rank: int,
        start_step: int,
        error_feedback: bool = True,
    ) -> None:
        super().__init__(counter, group, device)
        self.options: dict[str, Any] = {
            "process_group": group,
            "matrix_approximation_rank": rank,
            "start_powerSGD_iter": start_step,
            "use_error_feedback": error_feedback,
            "warm_start": True,
        }
        self.state = PowerSGDState(**self.options)

    @classmethod
    def from_config(
        cls,
        cfg: CommConfig,
        counter: CommCounter,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> PowerSGDHook:
        return cls(counter, group, device, cfg.powersgd_rank, cfg.powersgd_start_step)

    def reduce(self, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        state = self.state
        buffer = bucket.buffer()
        index = bucket.index()
        error = state.error_dict.get(index)
        if error is not None and error.numel() != buffer.numel():
            raise RuntimeError(
                f"powersgd: bucket {index} has {buffer.numel()} gradient entries but its "
                f"error-feedback state has {error.numel()}: the buckets changed since that "
                "state was saved (strategy.bucket_mb or the model); resume with the same ones"
            )
        compressing = state.iter >= state.start_powerSGD_iter
        sent_before = state.total_numel_after_compression
        future = powerSGD_hook(state, bucket)
        if not compressing:  # a plain all-reduce of the bucket
            self.counter.all_reduce(nbytes(buffer), self.world_size)
            return future
        # Three all-reduces: the uncompressed tensors, then P, then Q (each issued even when
        # empty, as torch does).
        p = state.p_memory_dict[index].numel()
        q = state.q_memory_dict[index].numel()
        uncompressed = state.total_numel_after_compression - sent_before - p - q
        for elements in (uncompressed, p, q):
            self.counter.all_reduce(elements * buffer.element_size(), self.world_size)
        return future

    def state_dict(self) -> dict[str, Any]:
        state = self.state
        kind, keys, pos, has_gauss, cached = state.rng.get_state(legacy=True)
        return {
            "iter": state.iter,
            "error": dict(state.error_dict),
            "p": dict(state.p_memory_dict),
            "q": dict(state.q_memory_dict),
            # NumPy's RandomState (it seeds each step's random Q), as plain data.
            "rng": {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "numel_before": state.total_numel_before_compression,
            "numel_after": state.total_numel_after_compression,
            "next_stats_report": state.next_stats_report,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self.state
        state.iter = int(saved["iter"])
        state.error_dict = self._to_device(saved["error"])
        state.p_memory_dict = self._to_device(saved["p"])
        state.q_memory_dict = self._to_device(saved["q"])
        rng = saved["rng"]
        state.rng.set_state(
            (
                rng["kind"],
                rng["keys"].numpy().astype(np.uint32),
                rng["pos"],
                rng["has_gauss"],
                rng["cached_gaussian"],
            )
        )
        state.total_numel_before_compression = int(saved["numel_before"])
        state.total_numel_after_compression = int(saved["numel_after"])
        state.next_stats_report = int(saved["next_stats_report"])

    def reset(self) -> None:
        self.state = PowerSGDState(**self.options)
