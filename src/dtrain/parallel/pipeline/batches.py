"""The pipeline's view of batches: the step's micro-batches as one batch of fixed shape, and
how an evaluation batch is cut into micro-batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtrain.errors import UserError


def eval_chunks(rows: int, micro_batches: int, pp: int, interleaved: bool) -> int:
    """Micro-batches for an evaluation batch of ``rows`` samples: the most (at most the
    training count) that split it into equal parts, as the schedules need."""
    for count in range(min(rows, micro_batches), 0, -1):
        if rows % count == 0 and (not interleaved or count % max(1, count // pp) == 0):
            return count
    return 1


def batch_signature(value: Any) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return (type(value).__name__,)


def check_tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise UserError(
            f"strategy 'pipeline': the batch's {what} are a {type(value).__name__}; a pipeline "
            "feeds its first stage one tensor (have Task.split_batch return tensors)"
        )
    return value


def stack_micro_batches(
    micro_batches: Sequence[tuple[Any, Any]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's micro-batches as one batch (the schedule cuts it back into the same pieces
    along dim 0). They must have equal shapes: each stage's buffers have one fixed shape."""
    inputs = [check_tensor(i, "inputs") for i, _ in micro_batches]
    targets = [check_tensor(t, "targets") for _, t in micro_batches]
    for what, parts in (("inputs", inputs), ("targets", targets)):
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) > 1:
            raise UserError(
                f"strategy 'pipeline': the micro-batches of a step have {what} of different "
                f"shapes {sorted(shapes)}; pipelining needs equal shapes: use fixed-length "
                "samples and data.split = 'samples'"
            )
    return torch.cat(inputs), torch.cat(targets)
