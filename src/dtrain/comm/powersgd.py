"""PowerSGD (Vogels et al., 2019): low-rank gradients with error feedback, counted and
checkpointable, its factors sent in fp32, fp16 or bf16 (``comm.powersgd_factors``).

Per bucket, each rank adds the error it kept from the step before to its gradient. Each
gradient matrix M (a tensor viewed as ``shape[0]`` rows, n x m) is then sent as two thin
factors with r = min(n, m, rank) columns: P = M Q (n x r), summed over the ranks and
orthonormalized, then Q = M^T P (m x r), averaged; every rank rebuilds M as P Q^T. Tensors where
that saves less than half (``(n + m) r x 2 >= n m``: biases, norms, 1-D tensors) are averaged
whole, in one all-reduce with the P factors. So a compressed step takes two all-reduces: the
tensors sent whole and P, then Q. What the approximation missed (the error-feedback residual:
this rank's gradient plus error, minus what every rank rebuilt) is added to the next step's
gradient. Q is kept from step to step (warm start: one power iteration a step refines it); the
first compressed step draws it at random, from a seed every rank draws alike. The first
``start_step`` steps are plain all-reduces.

The state is torch's ``PowerSGDState`` (step, error per bucket, P and Q memories, the seed
RNG), so the math and the checkpoint format are torch's ``powerSGD_hook``'s; the hook is our
own so that the factors can travel in a 16-bit format and the sums can go through a
shared-memory segment. In fp32 it gives torch's result bit for bit
(tests/test_compression.py). In fp16 or bf16 each all-reduce moves half the bytes; the
matrix products and the error stay in the gradients' precision (the orthonormalization in
fp32 at least), and the rounding of the factors ends up in the error that is sent later.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from dtrain.comm.accounting import CommCounter
from dtrain.comm.hooks import Bucket, CommHook
from dtrain.comm.mean import divide_

# A matrix is compressed when its factors are at least this many times smaller (torch's
# default ``min_compression_rate``).
MIN_COMPRESSION_RATE = 2

FACTOR_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def compresses(rows: int, cols: int, rank: int) -> bool:
    """Whether a ``rows`` x ``cols`` matrix goes as factors: they must be at least
    MIN_COMPRESSION_RATE times smaller than the matrix."""
    return (rows + cols) * min(rows, cols, rank) * MIN_COMPRESSION_RATE < rows * cols


class PowerSGDHook(CommHook):
    name = "powersgd"
    stateful = True
    sums_only = True  # every collective is a summing all-reduce

    def __init__(
        self,
        counter: CommCounter,
        group: dist.ProcessGroup | None,
        device: torch.device,
        rank: int,
        start_step: int,
        error_feedback: bool = True,
        factors: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(counter, group, device)
        self.options: dict[str, Any] = {
            "process_group": group,
            "matrix_approximation_rank": rank,
            "start_powerSGD_iter": start_step,
            "min_compression_rate": MIN_COMPRESSION_RATE,
            "use_error_feedback": error_feedback,
            "warm_start": True,
        }
        self.state = PowerSGDState(**self.options)
        self.factors = factors

    def reduce(self, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        state = self.state
        buffer = bucket.buffer()
        if state.iter < state.start_powerSGD_iter:  # a plain all-reduce of the bucket
            state.maybe_increase_iter(bucket)
            return self.mean_future(buffer)
        return self._compressed(bucket, buffer)

    def _compressed(
        self, bucket: Bucket, buffer: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        state = self.state
        index = bucket.index()
        error = self._add_error(index, buffer)  # from here on ``error`` holds the gradient sent
        matrices, whole = self._split(bucket.gradients())
        ps, qs, p_memory, q_memory = self._factor_views(index, matrices, buffer.dtype)
        for matrix, p, q in zip(matrices, ps, qs):
            q.copy_(_orthonormal(q))  # P's columns then have the gradient's own scale
            torch.matmul(matrix, q, out=p)
        # The tensors sent whole go first, already divided by the group size (their sum then
        # stays in range in fp16); P is orthonormalized after the sum, so it is not divided.
        first = torch.cat([*(divide_(t, self.world_size).reshape(-1) for t in whole), p_memory])

        def project(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            summed = fut.value()
            offset = 0
            for tensor in whole:
                tensor.copy_(summed[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
            p_memory.copy_(summed[offset:])
            for matrix, p, q in zip(matrices, ps, qs):
                p.copy_(_orthonormal(p))
                torch.matmul(matrix.t(), p, out=q)
            if not q_memory.numel():  # a bucket with no matrix (same on every rank)
                return q_memory
            return self.sum_future_as(q_memory, self.factors).wait()

        def rebuild(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            divide_(q_memory.copy_(fut.value()), self.world_size)
            for matrix, p, q in zip(matrices, ps, qs):
                torch.matmul(p, q.t(), out=matrix)
            if error is not None:  # what this rank meant to send, less what every rank rebuilt
                error.sub_(buffer)
            state.maybe_increase_iter(bucket)
            return buffer

        return self.sum_future_as(first, self.factors).then(project).then(rebuild)

    def _split(
        self, gradients: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gradients sent as factors (as matrices, grouped by shape in the order each shape
        first comes, as torch lays out its P and Q memories: the same random Q per matrix, and
        checkpoints either hook reads alike) and those sent whole (in bucket order)."""
        rank = self.state.matrix_approximation_rank
        by_shape: dict[torch.Size, list[torch.Tensor]] = {}
        whole: list[torch.Tensor] = []
        for tensor in gradients:
            matrix = tensor.view(tensor.shape[0], -1) if tensor.dim() > 1 else tensor
            if tensor.dim() > 1 and compresses(matrix.shape[0], matrix.shape[1], rank):
                by_shape.setdefault(matrix.shape, []).append(matrix)
            else:
                whole.append(tensor)
        return [matrix for group in by_shape.values() for matrix in group], whole

    def _add_error(self, index: int, buffer: torch.Tensor) -> torch.Tensor | None:
        """Add this bucket's error-feedback residual to ``buffer``; returns the residual's
        tensor, now holding a copy of the sum (None without error feedback)."""
        state = self.state
        if not state.use_error_feedback:
            return None
        error = state.error_dict.get(index)
        if error is None:
            error = state.error_dict[index] = torch.zeros_like(buffer)
        elif error.numel() != buffer.numel():
            raise RuntimeError(
                f"powersgd: bucket {index} has {buffer.numel()} gradient entries but its "
                f"error-feedback state has {error.numel()}: the buckets changed since that "
                "state was saved (strategy.bucket_mb or the model); resume with the same ones"
            )
        buffer.add_(error)
        return error.copy_(buffer)

    def _factor_views(
        self, index: int, matrices: list[torch.Tensor], dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Each matrix's P (n x r) and Q (m x r), as views of the bucket's P and Q memories (in
        the gradients' ``dtype``); Q is drawn at random where the bucket has none yet (its
        first compressed step)."""
        state = self.state
        rank = state.matrix_approximation_rank
        shapes = [(n, m, min(n, m, rank)) for n, m in (matrix.shape for matrix in matrices)]
        p_size = sum(n * r for n, _, r in shapes)
        q_size = sum(m * r for _, m, r in shapes)
        q_memory = state.q_memory_dict.get(index)
        fresh = q_memory is None or q_memory.numel() != q_size or q_memory.dtype != dtype
        if fresh:
            q_memory = torch.empty(q_size, device=self.device, dtype=dtype)
            state.q_memory_dict[index] = q_memory
            state.p_memory_dict[index] = torch.empty(p_size, device=self.device, dtype=dtype)
        assert q_memory is not None
        p_memory = state.p_memory_dict[index]
        ps = _views(p_memory, [(n, r) for n, _, r in shapes])
        qs = _views(q_memory, [(m, r) for _, m, r in shapes])
        if fresh:
            # The same seed on every rank (their RNGs advance alike), the same values: drawn on
            # the CPU, one matrix after the other, without touching torch's global RNG.
            generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
            for q in qs:
                q.copy_(torch.randn(q.shape, generator=generator, dtype=dtype))
        return ps, qs, p_memory, q_memory

    def state_dict(self) -> dict[str, Any]:
        state = self.state
        kind, keys, pos, has_gauss, cached = state.rng.get_state(legacy=True)
        return {
            "iter": state.iter,
            "error": dict(state.error_dict),
            "p": dict(state.p_memory_dict),
            "q": dict(state.q_memory_dict),
            # NumPy's RandomState (it seeds each bucket's first random Q), as plain data.
            "rng": {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
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

    def reset(self) -> None:
        self.state = PowerSGDState(**self.options)


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of ``matrix``'s columns (QR's Q), computed in fp32 at least (QR
    takes no 16-bit input)."""
    if matrix.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(matrix.float()).Q
    return torch.linalg.qr(matrix).Q


def _views(memory: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    sizes = [math.prod(shape) for shape in shapes]
    return [flat.view(shape) for flat, shape in zip(memory.split(sizes), shapes)]
