"""What a user gives dtrain: a model, datasets and a loss, built by a task factory.

A task factory is a plain function ``build(cfg) -> Task`` named on the command line as
``--run.task=package.module:function``. It may declare a dataclass for its own ``[task]`` config
section with :func:`task_config`, so that those keys are validated with the rest of the config,
in the parent process, before any worker starts::

    @dataclass
    class MyOptions:
        hidden: int = 128

    @dtrain.task_config(MyOptions)
    def build(cfg: dtrain.Config) -> dtrain.Task:
        model = MyNet(cfg.task.hidden)
        return dtrain.Task(model=model, train_data=MyDataset(), loss_fn=per_sample_loss)

Loss contract (the key to exact data parallelism): ``loss_fn(output, targets)`` returns the
*unreduced* per-item losses (``reduction="none"``). dtrain sums them on every rank and divides by
the number of items in the whole global batch, so the update is the same as one process taking
the mean over the whole batch -- also when ranks hold different numbers of samples or tokens.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.utils.data import default_collate

from dtrain.errors import UserError

if TYPE_CHECKING:
    from dtrain.config import Config

IGNORE_INDEX = -100


def split_input_target(batch: Any) -> tuple[Any, Any]:
    """Default batch layout: ``(inputs, targets)`` as an ordinary Dataset of pairs gives it; a
    dict with ``input`` and ``target``; or a dict with ``labels`` (Hugging Face's layout): the
    labels are the targets, the other keys the model's keyword arguments."""
    if isinstance(batch, Mapping):
        if "input" in batch and "target" in batch:
            return batch["input"], batch["target"]
        if "labels" in batch:
            return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
        if "tokens" in batch:
            raise UserError(
                f"a dict batch with keys {sorted(batch)}: prepared token shards, which the "
                "default layout does not split into inputs and targets: train on "
                "dtrain.data.text.TokenWindows(dataset, seq_len[, stride=1]) with "
                "collate_fn=collate_windows, or give Task.split_batch"
            )
        raise UserError(
            f"a dict batch with keys {sorted(batch)}: the default layout takes 'input' and "
            "'target', or 'labels' beside the model's keyword arguments (Hugging Face's "
            "layout); give Task.split_batch for another (a causal LM whose labels are its "
            "input ids: dtrain.hf.causal_lm_task)"
        )
    inputs, targets = batch
    return inputs, targets


def count_target_items(targets: Any) -> int:
    """Items the loss is averaged over: class-index targets count every entry that is not
    ``IGNORE_INDEX`` (padding), other targets count every element."""
    if not isinstance(targets, torch.Tensor):
        raise UserError(
            "targets are not a tensor: give Task.count_items to say how many items a batch holds"
        )
    if targets.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        # No negative index, no padding: one reduction instead of a comparison and a sum,
        # on every batch of every step.
        if targets.numel() == 0 or int(targets.min()) >= 0:
            return targets.numel()
        return int((targets != IGNORE_INDEX).sum())
    return targets.numel()


@dataclass
class Task:
    model: nn.Module
    train_data: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    val_data: Any = None
    collate_fn: Callable[[list[Any]], Any] = default_collate
    split_batch: Callable[[Any], tuple[Any, Any]] = split_input_target
    count_items: Callable[[Any], int] = count_target_items
    # Called on rank 0 after training with the trained (unwrapped) model; returns text to print,
    # e.g. samples from a language model.
    after_training: Callable[[nn.Module], str] | None = None
    # Named for the summary and the metrics: "tokens" for language models, else "samples".
    item_name: str = "samples"
    # The modules FSDP shards one by one, and that activation checkpointing and compile apply
    # to (default: the model's repeated blocks, see dtrain.parallel.recipe.find_blocks).
    shard_units: Callable[[nn.Module], list[nn.Module]] | None = None
    # For a model built on the meta device (``with torch.device("meta"): model = ...``: no
    # memory): initializes the parameters and buffers one module holds itself, as
    # ``model.apply(init_weights)`` calls it. Each rank then makes only its own part of the
    # model (a shard, a stage, a slice), with the same values at any world size and strategy
    # (dtrain.parallel.materialize).
    init_weights: Callable[[nn.Module], None] | None = None
    # The model as a chain of layers for strategy 'pipeline', each taking the previous one's
    # output (default: the model's own pipeline_layers(), or an nn.Sequential's children).
    # The layers may be adapters around the model's modules: checkpoints keep the model's own
    # names (dtrain.hf.pipeline_layers for Hugging Face GPT-2 and BERT).
    pipeline_layers: Callable[[nn.Module], list[nn.Module]] | None = None
    # Items (what count_items counts) every training sample holds, when all hold the same
    # number: a fixed-length window's tokens, 1 for a classifier's sample. Each rank then checks
    # every batch against it, and even a process's first step knows its global count from the
    # plan. Optional: without it, the ranks agree on every step's count in its gradient sync,
    # at no cost a step (dtrain.train.step).
    items_per_sample: int | None = None
    # The optimizer, instead of optim.name's: called once with the named parameters this
    # rank's optimizer updates -- of the model as the strategy holds it (FSDP's shards, a
    # pipeline stage's layers, under the model's own names) -- and returns the optimizer, e.g.
    # with param groups of one's own. Its state is checkpointed like the built-in one's.
    build_optimizer: Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer] | None = None
    # The learning-rate schedule, instead of optim.schedule's: called once with the optimizer
    # and train.steps; stepped once after every optimizer step; its state is checkpointed.
    build_scheduler: (
        Callable[[torch.optim.Optimizer, int], torch.optim.lr_scheduler.LRScheduler] | None
    ) = None
    # Evaluation metrics beside the loss: name -> fn(output, targets) returning the batch's
    # (sum, count), e.g. correct predictions and predictions made. dtrain adds the sums and
    # the counts over every batch and rank, each validation sample counted once, and reports
    # sum / count as val_<name> (docs/metrics.md): exact, not a mean of means.
    metrics: Mapping[str, Callable[[Any, Any], tuple[Any, Any]]] | None = None


TaskFactory = Callable[["Config"], Task]
F = TypeVar("F", bound=Callable[..., Any])


def task_config(config_class: type) -> Callable[[F], F]:
    """Declare the dataclass that validates a task factory's ``[task]`` config section."""

    def mark(fn: F) -> F:
        fn.config_class = config_class  # type: ignore[attr-defined]
        return fn

    return mark


def resolve_task(spec: str) -> TaskFactory:
    """Import ``package.module:function``; a failure is the user's, said in one line."""
    if ":" not in spec:
        raise UserError(f"run.task = {spec!r}: expected 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    # Tasks are found from the working directory, as with `python -m` (the workers are started
    # that way); the `dtrain` console script would otherwise not look there.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"run.task = {spec!r}: cannot import module {module_name!r} ({exc})"
        ) from None
    except Exception as exc:
        raise raised_on_import(f"run.task = {spec!r}: importing {module_name!r}", exc) from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UserError(f"run.task = {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise UserError(f"run.task = {spec!r}: {attr!r} is not a function")
    return factory


def raised_on_import(what: str, exc: Exception) -> UserError:
    """One line for an error that importing the user's code raised: what, and where."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return UserError(f"{what} raised {type(exc).__name__}: {exc} ({where.filename}:{where.lineno})")


def task_config_class(factory: TaskFactory) -> type | None:
    return getattr(factory, "config_class", None)


def build_task(factory: TaskFactory, cfg: Config) -> Task:
    task = factory(cfg)
    if not isinstance(task, Task):
        raise UserError(
            f"run.task = {cfg.run.task!r} returned {type(task).__name__}, expected a dtrain.Task"
        )
    return task
