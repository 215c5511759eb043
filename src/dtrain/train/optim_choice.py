"""Which optimizer and learning-rate schedule a run trains with: the task's own
(``Task.build_optimizer``, ``Task.build_scheduler``), checked against what the strategy holds,
or the config's (:mod:`dtrain.compute.optim`); and the kinds a checkpoint records, so that a
run never loads the state of another optimizer or schedule into its own."""

from __future__ import annotations

from typing import Any

import torch

from dtrain.compute.optim import build_optimizer, build_scheduler
from dtrain.config import Config
from dtrain.errors import CheckpointError, UserError
from dtrain.parallel.base import Strategy
from dtrain.task import Task

Scheduler = torch.optim.lr_scheduler.LRScheduler


def build_run_optimizer(task: Task, strategy: Strategy, cfg: Config) -> torch.optim.Optimizer:
    """The task's optimizer, over the parameters ``strategy`` holds (checked), or the
    config's."""
    named = list(strategy.named_parameters())
    if task.build_optimizer is None:
        return build_optimizer(named, cfg.optim)
    return checked_optimizer(task.build_optimizer(named), strategy, "Task.build_optimizer")


def checked_optimizer(optimizer: object, strategy: Strategy, what: str) -> torch.optim.Optimizer:
    """``optimizer``, as the user's builder ``what`` returned it, checked: a torch optimizer
    whose every parameter is one the strategy holds -- else it would step tensors that never
    get the synchronized gradients (a model's own parameters captured before FSDP replaced them
    with its shards, another model's)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"{what} returned {type(optimizer).__name__}, expected a torch.optim.Optimizer"
        )
    held = {id(p) for p in strategy.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in held]
    if foreign:
        shape = list(foreign[0].shape)
        raise UserError(
            f"{what} returned an optimizer over {len(foreign)} parameter(s) that "
            f"strategy {strategy.name!r} does not hold (the first of shape {shape}): build its "
            "groups from the named parameters it is called with, not from the model the task "
            "built (a strategy may replace them: fsdp with its shards, pipeline with a stage's)"
        )
    return optimizer


def build_run_scheduler(task: Task, optimizer: torch.optim.Optimizer, cfg: Config) -> Scheduler:
    """The task's schedule over ``optimizer``, or the config's."""
    if task.build_scheduler is None:
        return build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    scheduler = task.build_scheduler(optimizer, cfg.train.steps)
    if not isinstance(scheduler, Scheduler):
        raise UserError(
            f"Task.build_scheduler returned {type(scheduler).__name__}, expected a "
            "torch.optim.lr_scheduler.LRScheduler"
        )
    if scheduler.optimizer is not optimizer:
        raise UserError(
            "Task.build_scheduler returned a schedule of another optimizer: build it over the "
            "optimizer it is called with"
        )
    return scheduler


def kind_of(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


class OptimizerKinds:
    """A training-state part: the classes of the optimizer and the schedule. Loaded before
    their states (:func:`dtrain.checkpoint.state.load`), so that a checkpoint of another
    optimizer is one line naming both, not torch's error about parameter groups -- or, worse,
    a state of the same shape loaded into an optimizer that reads it otherwise."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Scheduler) -> None:
        self.kinds = {"optimizer": kind_of(optimizer), "scheduler": kind_of(scheduler)}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.kinds)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, mine in self.kinds.items():
            theirs = state.get(part)
            if theirs is not None and theirs != mine:
                raise CheckpointError(
                    f"the checkpoint holds the state of a {theirs} {part}, this run trains with "
                    f"a {mine}: resume with the {part} that saved it, or start a new run (a "
                    "fresh run folder, or run.init_from to take the checkpoint's weights only)"
                )
