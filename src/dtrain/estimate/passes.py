"""The measured passes an estimate is made of: one micro-batch's forward and backward through
the model, or through one pipeline stage, on fake tensors (:func:`.probe.profile_pass`), with
the configured activation checkpointing and with the other choice. Each pass runs on a fresh
fake copy of the task's model, cut as one rank of a tensor-parallel group holds it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dtrain.compute.model_call import call_model
from dtrain.compute.precision import Precision
from dtrain.errors import UserError
from dtrain.estimate.probe import (
    PassProfile,
    SavedProfile,
    cut_for_tensor_parallel,
    fake_batch,
    fake_model,
    profile_pass,
    storage_key,
)
from dtrain.parallel.recipe import Recipe, model_blocks
from dtrain.task import Task

Batch = tuple[Any, Any]


@dataclass
class Passes:
    """One micro-batch's pass with each of two activation-checkpointing choices (``every``:
    0 none, K every K-th block). What the forward saves is read from the pass without
    checkpointing -- a checkpointed block hides its saved tensors from the hooks -- and each
    choice's activations follow from it (:meth:`SavedProfile.activations`)."""

    runs: dict[int, PassProfile]  # checkpoint_every -> its pass; 0 is always among them

    def activations(self, every: int, through: int | None = None) -> int:
        """What the forward keeps for backward (``through``: only what the blocks up to that
        one and no block keep, :meth:`SavedProfile.activations`)."""
        return self.runs[0].saved.activations(every, through)

    def working(self, every: int, with_grads: bool = False) -> int:
        """The pass's peak (at least its activations): the parameters' gradients freed as
        each is complete, or kept (``with_grads``: a first micro-batch whose gradients did
        not exist before it)."""
        run = self.runs[every]
        return max(run.working_with_grads if with_grads else run.working, self.activations(every))


def measure_both(every: int, measure: Callable[[int], PassProfile]) -> Passes:
    """``measure`` with ``every`` and with the other choice (full where it is none)."""
    return Passes({choice: measure(choice) for choice in {0, every or 1}})


@dataclass(frozen=True)
class Shape:
    """A tensor's shape, strides and dtype (what a pipeline stage receives)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class StagePass:
    """One pipeline stage's pass with some activation checkpointing, and what it receives and
    sends per micro-batch."""

    run: PassProfile  # with the checkpointing ``every`` says
    saved: SavedProfile  # of the stage's pass without checkpointing (see Passes)
    every: int
    input_bytes: int  # what it receives (0 on the first stage: the batch)
    output: Shape  # what it sends, which the next stage receives
    output_bytes: int  # its storage's bytes (kept until the micro-batch's backward)
    output_saved: bool  # whether its forward saved its output anyway

    @property
    def kept(self) -> int:
        """Bytes one micro-batch in flight holds on this stage: what its forward saved and
        its output, which the schedule keeps until the micro-batch's backward."""
        unsaved = 0 if self.output_saved else self.output_bytes
        return self.saved.activations(self.every) + unsaved

    @property
    def working(self) -> int:
        """The peak of one micro-batch's forward and backward through the stage (the
        parameters' gradients freed as each is complete)."""
        return self._peak(self.run.working)

    @property
    def working_with_grads(self) -> int:
        """The same, the parameters' gradients kept as they are made."""
        return self._peak(self.run.working_with_grads)

    def _peak(self, measured: int) -> int:
        unsaved = 0 if self.output_saved else self.output_bytes
        return max(measured, self.saved.activations(self.every)) + unsaved


class Prober:
    """Runs passes of the task's model under the run's precision, each on a fresh fake copy
    of it (``tp`` > 1: cut as one rank of a tensor-parallel group holds it, ``cuts`` naming
    each cut linear map's style)."""

    def __init__(self, task: Task, precision: Precision, tp: int, cuts: dict[str, str]) -> None:
        self.task = task
        self.precision = precision
        self.tp = tp
        self.cuts = cuts

    def fresh(self, every: int, mode: FakeTensorMode) -> tuple[nn.Module, list[nn.Module]]:
        """A fake copy of the model with every ``every``-th block checkpointed (0: none), and
        its blocks."""
        model = fake_model(self.task.model, mode)
        if self.tp > 1:
            cut_for_tensor_parallel(model, self.cuts, self.tp)
        blocks = self.blocks(model)
        if every:
            Recipe(self.precision, every).apply(blocks)
        return model, blocks

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's blocks (the recipe's and FSDP's units); none where it has none."""
        try:
            return model_blocks(self.task, model, "train.activation_checkpointing")
        except UserError:
            return []

    def whole(self, batch: Batch, every: int) -> PassProfile:
        """The model's forward and loss on ``batch``, then backward."""
        mode = FakeTensorMode()
        model, blocks = self.fresh(every, mode)
        inputs, targets = fake_batch(batch, mode)
        loss_fn = self.task.loss_fn

        def run() -> torch.Tensor:
            return loss_fn(call_model(model, inputs), targets).sum()

        return profile_pass(model, (inputs, targets), run, blocks, self.precision.autocast, mode)

    def layers(self, model: nn.Module) -> list[nn.Module]:
        from dtrain.parallel.pipeline.split import model_layers

        return model_layers(model, self.task.pipeline_layers)

    def stage(
        self, batch: Batch, span: range, received: Shape | None, last: bool, every: int
    ) -> StagePass:
        """The forward (and the loss, on the last stage) and backward of the pipeline layers
        in ``span`` on one micro-batch; ``received``: what the stage gets from the one before
        (None: the first stage, which gets the batch's inputs)."""
        mode = FakeTensorMode()
        model, blocks = self.fresh(every, mode)
        layers = self.layers(model)[span.start : span.stop]
        inputs, targets = fake_batch(batch, mode)
        if received is not None:
            with mode:
                inputs = torch.empty_strided(received.shape, received.stride, dtype=received.dtype)
                inputs.requires_grad_(received.dtype.is_floating_point)
        sent: dict[str, Any] = {}  # of the output: storage key, bytes, shape
        loss_fn = self.task.loss_fn

        def run() -> torch.Tensor:
            x = inputs
            for layer in layers:
                x = layer(x)
            sent["key"], sent["bytes"] = storage_key(x)
            sent["shape"] = Shape(tuple(x.shape), tuple(x.stride()), x.dtype)
            return loss_fn(x, targets).sum() if last else x

        profile = profile_pass(model, (inputs, targets), run, blocks, self.precision.autocast, mode)
        return StagePass(
            run=profile,
            saved=profile.saved,
            every=every,
            input_bytes=0 if received is None else received.bytes,
            output=sent["shape"],
            output_bytes=sent["bytes"],
            output_saved=sent["key"] in profile.saved.saved,
        )
