"""The training state: one dict of state_dicts, one key per component (``model``,
``optimizer``, ``scheduler``, ``kinds``, ``data``, ``trainer``, ``balance``, ``rng``, ``comm``;
the files they land in: docs/fault-tolerance.md, "Checkpoints").

The trainer builds a :class:`TrainingState` once -- the stateful parts, never the trainer
itself -- and hands it to :func:`save` and :func:`load` (as torchtitan's checkpointer takes
``states=``). The strategy gives and takes the model and optimizer as named state dicts in its
form (:mod:`dtrain.checkpoint.model_state`). Everything is tensors and plain data, loaded as
nothing else (:mod:`dtrain.checkpoint.safe_load`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dtrain import __version__
from dtrain.checkpoint import layout, model_state
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.model_state import ModelState
from dtrain.checkpoint.resume import ResumePoint
from dtrain.checkpoint.rng import rng_state, set_rng_state
from dtrain.checkpoint.write import Checkpointer
from dtrain.config import Config
from dtrain.dist.runtime import Runtime
from dtrain.errors import CheckpointError


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint holds, as the parts that hold it."""

    strategy: ModelState  # the model, and how it and the optimizer are laid out
    optimizer: torch.optim.Optimizer
    # Saved whole by rank 0 into train_state.pt, one key each: scheduler, data, trainer.
    parts: Mapping[str, Stateful]
    runtime: Runtime
    config: Config
    # Parts a checkpoint may lack (the loss scaler, saved by a run in another precision); such
    # a part keeps the state it was built with.
    optional: frozenset[str] = frozenset()


def save(state: TrainingState, checkpointer: Checkpointer, step: int, *, blocking: bool) -> None:
    """Collective: every rank saves its part of ``state`` as checkpoint ``step``."""
    runtime = state.runtime
    model_parts = model_state.parts_to_write(state.strategy, state.optimizer, runtime.is_main)
    files: dict[str, Any] = {layout.rng_file(runtime.rank): rng_state()}
    meta: dict[str, Any] | None = None
    if runtime.is_main:
        train_state = {name: part.state_dict() for name, part in state.parts.items()}
        files[layout.TRAIN_STATE_FILE] = train_state
        meta = {
            "step": step,
            "world_size": runtime.world_size,
            "data_parallel_size": state.strategy.data_parallel_size,
            "strategy": state.config.strategy.name,
            "config": state.config.to_toml(),
            "dtrain_version": __version__,
            "torch_version": torch.__version__,
            "data": train_state.get("data"),
        }
    files.update(model_parts.files)
    checkpointer.save(step, files, meta, blocking=blocking, sharded=model_parts.sharded)


def load(state: TrainingState, point: ResumePoint) -> bool:
    """Collective: load every part of ``state`` from checkpoint ``point``. Returns whether this
    rank's RNG state was restored too: only at the world size that saved it (after a change,
    the ranks are other processes, and each needs a fresh stream of its own). A store's
    checkpoint reads what this rank verified from its local copies, which go at the end."""
    try:
        return _load(state, point)
    finally:
        point.loaded()


def _load(state: TrainingState, point: ResumePoint) -> bool:
    train_state = ckread.load_file(point.path, layout.TRAIN_STATE_FILE)
    missing = sorted(set(state.parts) - set(train_state) - state.optional)
    if missing:
        raise CheckpointError(
            f"{point.path / layout.TRAIN_STATE_FILE} holds no {', '.join(missing)} state: it "
            "was saved by a version of dtrain that did not have it; resume it with that "
            "version or start a new run"
        )
    # The parts first: one of them may refuse the checkpoint (another optimizer's, see
    # dtrain.train.optim_choice) before the optimizer state is loaded into this run's.
    for name, part in state.parts.items():
        if name in train_state:
            part.load_state_dict(train_state[name])
    model_state.load(state.strategy, state.optimizer, point.path)
    rng_path = point.path / layout.rng_file(state.runtime.rank)
    if point.world_size != state.runtime.world_size or not rng_path.exists():
        return False
    set_rng_state(ckread.load_file(point.path, rng_path.name))
    return True
