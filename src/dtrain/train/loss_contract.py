"""The loss contract, checked: ``Task.loss_fn`` returns one loss per item, unreduced.

A reduced loss, or one with another number of values than the items counted, trains on silently
wrong math, so every call is checked against its targets: as many values as target elements is
accepted without counting (the common case costs nothing); else as many as the items the task
counts, or one per shifted position ``labels[..., 1:]`` (counting reads the targets: on a GPU one
wait; a layout once found right is not counted again). Anything else is a one-line
:class:`~dtrain.errors.UserError` naming the fix, before the step's update. The cases and the
messages: docs/models.md, "The loss contract, checked".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dtrain.errors import UserError

LossFn = Callable[[Any, Any], torch.Tensor]
CountFn = Callable[[Any], int]


class LossContract:
    """Checks the calls of a task's loss function (see the module's docstring)."""

    def __init__(self, count_items: CountFn) -> None:
        self.count_items = count_items
        self.source = "Task.loss_fn returned"  # what the messages say gave the losses
        # (loss shape, target shape) found to hold one value per counted item: a layout that
        # repeats (fixed-length data) is not counted again.
        self._exact: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        self._wrapped: tuple[LossFn, LossFn] | None = None

    def wrap(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` whose every call is checked (the same wrapper while ``loss_fn`` is)."""
        if self._wrapped is not None and self._wrapped[0] is loss_fn:
            return self._wrapped[1]

        def checked(output: Any, targets: Any) -> torch.Tensor:
            try:
                losses = loss_fn(output, targets)
            except (TypeError, AttributeError) as exc:
                if not is_model_output(output):
                    raise
                raise UserError(model_output_message(output, exc)) from exc
            self.check(losses, targets)
            return losses

        self._wrapped = (loss_fn, checked)
        return checked

    def check(self, losses: Any, targets: Any) -> None:
        if not isinstance(losses, torch.Tensor):
            raise UserError(
                f"{self.source} a {type(losses).__name__}; it must return a tensor of "
                'per-item losses (reduction="none")'
            )
        values = losses.numel()
        target_shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else None
        if target_shape is not None and values == targets.numel():
            return
        layout = (tuple(losses.shape), target_shape or ())
        if layout in self._exact:
            return
        items = int(self.count_items(targets))
        if values == items:
            self._exact.add(layout)
            return
        shifted = shifted_positions(target_shape)
        if shifted is not None and values == shifted and items <= shifted:
            return  # a shifted-label loss over padded sequences: ignored positions are zeros
        raise UserError(contract_message(losses, target_shape, items, shifted, self.source))


def is_model_output(output: Any) -> bool:
    """A structured model output that carries logits (a Hugging Face ``ModelOutput``)."""
    return not isinstance(output, torch.Tensor) and isinstance(
        getattr(output, "logits", None), torch.Tensor
    )


def model_output_message(output: Any, exc: Exception) -> str:
    return (
        f"Task.loss_fn failed on the model's {type(output).__name__} ({type(exc).__name__}: "
        f"{exc}): a Hugging Face model returns its logits in a ModelOutput -- read them in the "
        'loss (loss_fn=lambda out, y: F.cross_entropy(out.logits, y, reduction="none")), or '
        "use dtrain.hf.causal_lm_task / sequence_classification_task, whose losses do"
    )


def shifted_positions(target_shape: tuple[int, ...] | None) -> int | None:
    """Positions a loss that shifts its labels by one along the last dimension predicts:
    ``labels[..., 1:]`` (None for targets with no sequence dimension)."""
    if target_shape is None or len(target_shape) < 2:
        return None
    return math.prod((*target_shape[:-1], target_shape[-1] - 1))


def contract_message(
    losses: torch.Tensor,
    target_shape: tuple[int, ...] | None,
    items: int,
    shifted: int | None,
    source: str,
) -> str:
    values = losses.numel()
    head = (
        f"{source} {values} value(s) (shape {tuple(losses.shape)}) for {items} counted item(s)"
        + (f" (targets of shape {target_shape})" if target_shape is not None else "")
        + ": it must return one loss per item, unreduced, which dtrain averages over the "
        "whole global batch"
    )
    if values == 1 or losses.dim() == 0:
        fix = (
            'it looks reduced: use reduction="none" (e.g. F.cross_entropy(logits, targets, '
            'reduction="none"))'
        )
    elif shifted is not None and values == shifted:
        fix = (
            "it looks like a loss that shifts its labels (Hugging Face causal LM: labels = "
            "input ids, each position predicting the next): such a loss counts labels[:, 1:] -- "
            "give Task.count_items = lambda labels: int((labels[:, 1:] != -100).sum()), or "
            "use dtrain.hf.causal_lm_task"
        )
    else:
        fix = (
            "return one value per counted item, or give Task.count_items counting what the "
            "loss holds"
        )
    return f"{head}; {fix}"
