"""The model's and optimizer's state between a strategy and a checkpoint's files.

A strategy (:class:`ModelState`) gives named state dicts, each with its form
(:mod:`dtrain.checkpoint.forms`), and takes them back; it never sees a file. Saving writes each
form where it belongs (:func:`parts_to_write`); loading (:func:`load`) reads whatever form was
saved into the one the strategy asks for: its own form where they match (per rank: this
rank's replica when saved at this size, else rank 0's; shards of the same optimizer layout:
DCP reshards), else by parameter name (:mod:`.cross_form`).

The parts beside the model and optimizer (a comm hook's residuals, diloco's ``outer``) are
read in the form they were saved in; the strategy gets those the checkpoint holds, and where
the state came from (:class:`~dtrain.checkpoint.forms.Origin`), and decides what a missing one
means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.cross_form import load_whole_into_shards, read_in_saved_groups
from dtrain.checkpoint.forms import Form, Origin, Part
from dtrain.comm.plain import all_gather_json
from dtrain.storage.objects import Location

MODEL_AND_OPTIMIZER = ("model", "optimizer")


class ModelState(Protocol):
    """What lays out the model and optimizer state (a strategy: it knows how they are spread
    over the ranks); its methods are documented on :class:`dtrain.parallel.base.Strategy`."""

    @property
    def state_form(self) -> Form: ...  # of its model and optimizer

    @property
    def settings_per_name(self) -> bool: ...  # a sharded optimizer's settings per parameter

    @property
    def data_parallel_rank(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> dict[str, Part]: ...

    def load_state_dicts(
        self, optimizer: torch.optim.Optimizer, states: dict[str, Any]
    ) -> None: ...

    def state_dicts_by_name(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    def load_state_dicts_by_name(
        self, optimizer: torch.optim.Optimizer, states: dict[str, Any]
    ) -> None: ...

    def load_beside(self, parts: dict[str, Any], origin: Origin) -> None: ...


@dataclass
class CheckpointParts:
    """This rank's share of the model and optimizer state in a checkpoint."""

    files: dict[str, Any] = field(default_factory=dict)  # file name -> state (torch.save)
    sharded: dict[str, Any] | None = None  # a state every rank writes through DCP


def parts_to_write(
    strategy: ModelState, optimizer: torch.optim.Optimizer, is_main: bool
) -> CheckpointParts:
    """What this rank writes of the strategy's state: its replicated parts only on rank 0."""
    out = CheckpointParts()
    rank = strategy.data_parallel_rank
    for name, part in strategy.state_dicts(optimizer).items():
        if part.form is Form.SHARDED:
            out.sharded = {**(out.sharded or {}), name: part.state}
        elif part.form is Form.PER_RANK or is_main:
            out.files[layout.part_file(name, part.form, rank)] = part.state
    return out


def load(strategy: ModelState, optimizer: torch.optim.Optimizer, step_dir: Location) -> None:
    """Collective: the strategy's state from the checkpoint in ``step_dir``, whatever form
    saved it; a model that does not fit is named key by key."""
    meta = ckread.load_meta(step_dir)
    step = int(meta.get("step", 0))
    saved = int(meta.get("data_parallel_size", meta.get("world_size", 1)))
    template = strategy.state_dicts(optimizer)
    per_rank = saved > 1 and (step_dir / layout.part_file("model", Form.PER_RANK, 1)).exists()
    # Each rank takes its own replica only where there is one for each (saved at this size).
    own = saved == strategy.data_parallel_size and (per_rank or saved == 1)
    rank = strategy.data_parallel_rank if strategy.state_form is Form.PER_RANK and own else 0
    if rank > 0:
        _load_whole(strategy, optimizer, step_dir, template, rank)
    elif (step_dir / layout.SHARDED_DIR).is_dir():
        _load_shards(strategy, optimizer, step_dir, template)
    elif strategy.state_form is Form.SHARDED:
        state = strategy.state_dicts_by_name(optimizer)
        load_whole_into_shards(state, step_dir, _wanted(strategy, state))
        strategy.load_state_dicts_by_name(optimizer, state)
    else:
        _load_whole(strategy, optimizer, step_dir, template, 0)
    beside: dict[str, Any] = {}
    sharded: dict[str, Any] = {}
    for name, part in template.items():
        if name in MODEL_AND_OPTIMIZER:
            continue
        if part.form is Form.SHARDED:  # a further model's (dtrain.loop.models): in the shards
            sharded[name] = part.state
            continue
        file = layout.part_file(name, part.form, strategy.data_parallel_rank)
        if (step_dir / file).exists():
            beside[name] = ckread.load_file(step_dir, file)
    if sharded and (step_dir / layout.SHARDED_DIR).is_dir():
        keys = ckread.sharded_index(step_dir).keys
        held = {n: s for n, s in sharded.items() if any(k.startswith(f"{n}.") for k in keys)}
        if held:  # collective: the same names on every rank (one index)
            ckread.load_sharded(step_dir, held)
        beside.update(held)
    strategy.load_beside(beside, Origin(step_dir.name, step, saved, per_rank, own))


def _load_whole(
    strategy: ModelState,
    optimizer: torch.optim.Optimizer,
    step_dir: Location,
    template: dict[str, Part],
    rank: int,
) -> None:
    """Whole files (rank ``rank``'s replica) into a whole state, the model checked first."""
    model = ckread.load_file(step_dir, layout.part_file("model", Form.PER_RANK, rank))
    ckread.check_model_fits(template["model"].state, model, step_dir)
    optim = ckread.load_file(step_dir, layout.part_file("optimizer", Form.PER_RANK, rank))
    strategy.load_state_dicts(optimizer, {"model": model, "optimizer": optim})


def _load_shards(
    strategy: ModelState,
    optimizer: torch.optim.Optimizer,
    step_dir: Location,
    template: dict[str, Part],
) -> None:
    """Shards laid out as the strategy lays them out are read as they are; anything else
    (whole replicas, or shards keyed otherwise: pipeline's settings per parameter, fsdp's and
    tensor's list of groups) by parameter name."""
    index = ckread.sharded_index(step_dir)
    own = strategy.state_form is Form.SHARDED and (
        index.settings_per_name == strategy.settings_per_name
    )
    if own:
        state = {name: part.state for name, part in template.items() if name in MODEL_AND_OPTIMIZER}
    else:
        state = strategy.state_dicts_by_name(optimizer)
    ckread.check_model_fits(_wanted(strategy, state), index.model, step_dir)
    read_in_saved_groups(state, step_dir, index)
    if own:
        strategy.load_state_dicts(optimizer, state)
    else:
        strategy.load_state_dicts_by_name(optimizer, state)


def _wanted(strategy: ModelState, state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes of the model that all ranks together hold (collective where sharded: a rank
    may hold only part of it, a pipeline stage)."""
    wanted = {key: tuple(value.shape) for key, value in state["model"].items()}
    if strategy.state_form is Form.SHARDED and dist.is_initialized():
        every = all_gather_json({key: list(shape) for key, shape in wanted.items()})
        wanted = {key: tuple(shape) for part in every for key, shape in part.items()}
    return wanted
