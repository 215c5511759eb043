"""What every strategy does to the model's blocks besides spreading them over ranks:
activation checkpointing and ``torch.compile`` (``train.activation_checkpointing``,
``train.compile``), and the precision every forward runs in (``train.precision``).

A strategy applies them in one order, torchtitan's: tensor parallelism first (it replaces the
blocks' linear maps), then activation checkpointing, then compile (it traces the checkpointed
forward), then the data-parallel wrapper (FSDP's sharding units, DDP). Both act on the blocks in
place, keeping class, parameters and names, so checkpoint keys never change and a run resumes
with either switched. Checkpointing restores the first forward's RNG state (dropout draws the
same masks: the gradients are the plain block's bits); compile is regional, one graph shared by
repeated blocks (docs/recipes.md, ``train.activation_checkpointing`` and ``train.compile``).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from dtrain.compute.precision import Precision
from dtrain.config import Config, parse_activation_checkpointing
from dtrain.errors import ConfigError, UserError
from dtrain.task import Task


@dataclass
class Recipe:
    precision: Precision
    checkpoint_every: int = 0  # 0: no activation checkpointing; K: every K-th block
    compile: bool = False
    seed: int = 0  # of a meta-built model's values (run.seed)

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device) -> Recipe:
        train = cfg.train
        return cls(
            precision=Precision(train.precision, device),
            checkpoint_every=parse_activation_checkpointing(train.activation_checkpointing),
            compile=train.compile,
            seed=cfg.run.seed,
        )

    def describe(self) -> str:
        """The options that change the blocks, as the config names them (for errors)."""
        keys = []
        if self.checkpoint_every:
            keys.append("train.activation_checkpointing")
        if self.compile:
            keys.append("train.compile")
        return " and ".join(keys) or "the recipe"

    @property
    def changes_blocks(self) -> bool:
        return self.checkpoint_every > 0 or self.compile

    def apply(self, blocks: Sequence[nn.Module]) -> None:
        """Activation checkpointing, then compile, on ``blocks`` in place (see the module's
        docstring for where a strategy calls this)."""
        if self.checkpoint_every:
            for index, block in enumerate(blocks):
                if index % self.checkpoint_every == 0:
                    checkpoint_forward(block)
        if self.compile:
            for block in blocks:
                block.compile()


def model_blocks(task: Task, model: nn.Module, why: str) -> list[nn.Module]:
    """The units a recipe (and FSDP) applies to: ``Task.shard_units(model)`` when the task
    gives it, else the model's repeated blocks; ``why`` names the option that needs them."""
    if task.shard_units is not None:
        return list(task.shard_units(model))
    try:
        return find_blocks(model)
    except UserError as exc:
        raise UserError(f"{why}: {exc}") from None


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: ``model.blocks`` / ``layers`` / ``h`` / ``layer`` when it is
    a non-empty ``ModuleList`` (or ``Sequential``), else the longest ``ModuleList`` anywhere in
    the model (the first of the longest)."""
    for name in ("blocks", "layers", "h", "layer"):
        candidate = getattr(model, name, None)
        if isinstance(candidate, (nn.ModuleList, nn.Sequential)) and len(candidate) > 0:
            return list(candidate)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if lists:
        longest: nn.ModuleList = max(lists, key=len)
        return list(longest)
    raise ConfigError(
        f"cannot find the repeated blocks of {type(model).__name__} (the units it applies "
        "to, one by one): "
        "expected an nn.ModuleList attribute named blocks, layers or h (or give "
        "Task.shard_units)"
    )


def checkpoint_forward(module: nn.Module) -> None:
    """Make ``module``'s forward an activation-checkpointed one, in place (an instance method
    that calls the class's forward: the module keeps its class and its parameters' names)."""
    module.forward = types.MethodType(_checkpointed_forward, module)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(
        type(self).forward, self, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
    )
