"""One step's batch in an own loop (:class:`Batch`), and the :class:`~dtrain.Task` that
``run.prepare``'s model and data make (:func:`own_task`), with the loss a strategy's set-up pass
sees there (:func:`output_sum`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dtrain.data.loader import StepBatch
from dtrain.errors import UserError
from dtrain.parallel.base import BackwardSyncControl, Strategy
from dtrain.task import Task
from dtrain.train.trainer import Trainer

# What prepare() takes beside the model and the data: the Task's fields that the own loop
# uses (the loss, the evaluation and after-training hooks are the loop's own business; a
# pipeline's layers are refused with the strategy).
PREPARE_OPTIONS = frozenset(
    {
        "collate_fn",
        "split_batch",
        "count_items",
        "item_name",
        "shard_units",
        "init_weights",
        "items_per_sample",
        "build_optimizer",
        "build_scheduler",
    }
)


def own_task(model: nn.Module, train_data: Any, options: dict[str, Any]) -> Task:
    """The Task of ``run.prepare(model, train_data, **options)``; unknown options are one
    line."""
    unknown = sorted(set(options) - PREPARE_OPTIONS)
    if unknown:
        raise UserError(
            f"run.prepare() got {', '.join(unknown)}: it takes {', '.join(sorted(PREPARE_OPTIONS))}"
        )
    return Task(model=model, train_data=train_data, loss_fn=output_sum, **options)


def output_sum(output: Any, targets: Any) -> torch.Tensor:
    """The loss a strategy's set-up pass sees in an own loop (DDP's throwaway backward that
    settles its buckets, :meth:`DDPStrategy.before_first_step`): the sum of every floating
    tensor the model returned, so that backward reaches every parameter the loss would."""
    if isinstance(output, Mapping):  # a Hugging Face ModelOutput is one
        output = list(output.values())
    tensors = output if isinstance(output, (list, tuple)) else [output]
    parts = [
        t.float().sum() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return torch.stack(parts).sum().reshape(1)


class Batch:
    """This rank's part of one optimizer step: iterate it for its micro-batches, each an
    ``(inputs, targets)`` pair on the device, under the strategy's precision, with no gradient
    sync but on the last one (of every model's). After :meth:`Run.update`, iterate it again for
    the next phase."""

    def __init__(
        self,
        trainer: Trainer,
        begin: Callable[[Batch], None],
        further: list[Strategy],
        batch: StepBatch,
        micro: list[Any],
        items: int,
    ) -> None:
        self._trainer, self._begin, self._further = trainer, begin, further
        self.step_batch = batch
        self.micro = micro
        self.items = items  # this rank's items (Task.count_items), of every micro-batch
        self.begun = False  # the step's first half has run (Run._begin)
        self.current = -1  # the micro-batch being trained
        self.done: set[int] = set()  # micro-batches whose backward ran, in this phase

    # -- the loop's calls in order, each mistake one line ----------------------------------

    @staticmethod
    def training(batch: Batch | None) -> Batch:
        """The batch whose current micro-batch a ``run.backward()`` trains."""
        if batch is None or batch.current < 0:
            raise UserError(
                "run.backward() outside a batch: call it for each micro-batch of "
                "`for inputs, targets in batch`, where `batch` comes from run.batches()"
            )
        if batch.current in batch.done:
            raise UserError(
                "run.backward() twice for one micro-batch: add the losses (per item) and call "
                "it once"
            )
        return batch

    @staticmethod
    def stepping(batch: Batch | None, loss_sum: torch.Tensor | None) -> tuple[Batch, torch.Tensor]:
        """The batch a ``run.step()`` ends, every micro-batch's backward run, and the phase's
        loss sum (``loss_sum``: None before the phase's first backward)."""
        if batch is None:
            raise UserError("run.step() outside the loop: call it once per run.batches() batch")
        if loss_sum is None:
            raise UserError(
                f"run.step() before run.backward(): step {batch._trainer.step + 1} has no "
                "gradient; call run.backward(per-item losses) for each of its micro-batches"
            )
        if len(batch.done) != len(batch.micro):
            raise UserError(
                f"run.step() after the backward of {len(batch.done)} of the step's "
                f"{len(batch.micro)} micro-batches: call run.backward() for each"
            )
        return batch, loss_sum

    @staticmethod
    def updating(batch: Batch | None, loss_sum: torch.Tensor | None) -> tuple[Batch, torch.Tensor]:
        """The batch whose phase a ``run.update()`` ends, every micro-batch's backward run,
        and the phase's loss sum."""
        if batch is None or loss_sum is None or len(batch.done) != len(batch.micro):
            done = 0 if batch is None else len(batch.done)
            total = "the step's" if batch is None else f"the step's {len(batch.micro)}"
            raise UserError(
                f"run.update() after the backward of {done} of {total} micro-batches in this "
                "phase: call run.backward() for each, then run.update()"
            )
        return batch, loss_sum

    @property
    def sample_ids(self) -> list[int]:
        """The global ids of this rank's samples in this step, micro-batch after
        micro-batch."""
        return [int(i) for ids in self.step_batch.ids for i in ids]

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        trainer = self._trainer
        strategy = trainer.strategy
        last = len(self.micro) - 1
        # The liveness record says what dtrain's loop says meanwhile (a hang is named by it).
        with trainer.phase("forward_backward"):
            for index, micro in enumerate(self.micro):
                if not self.begun:
                    self.begun = True
                    self._begin(self)  # the step's first half (Run._begin)
                self.current = index
                with contextlib.ExitStack() as sync:
                    if index < last:  # every wrapped model's gradients: on the last only
                        for each in (strategy, *self._further):
                            if isinstance(each, BackwardSyncControl):
                                sync.enter_context(each.no_backward_sync())
                    sync.enter_context(strategy.recipe.precision.autocast())
                    yield micro
