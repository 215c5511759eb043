"""The training state: one dict of state_dicts, one key per component.

=================  ========================================  =========================
key                what                                      file (written by)
=================  ========================================  =========================
``model``          parameters and buffers                    model.pt (rank 0), or dcp/
``optimizer``      optimizer state                           optimizer.pt (rank 0), or dcp/
``scheduler``      LR schedule position                      train_state.pt (rank 0)
``data``           stream position, seed, dataset identity   train_state.pt (rank 0)
``trainer``        step, items seen, skipped steps, ...      train_state.pt (rank 0)
``rng``            Python, NumPy, torch (and CUDA) RNG       rng-rankNNNNN.pt (each rank)
meta               step, world size, config, versions        meta.json (rank 0)
=================  ========================================  =========================

Everything is tensors and plain data, loaded with ``torch.load(weights_only=True)``. Sharded
strategies (model and optimizer state differ across ranks) save those two through
``torch.distributed.checkpoint`` into ``dcp/`` instead, one file set per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtrain import __version__
from dtrain.errors import CheckpointError
from dtrain.fault import checkpoint_read as ckread
from dtrain.fault.resume import ResumePoint, check_model_fits
from dtrain.fault.rng import rng_state, set_rng_state
from dtrain.parallel.base import ShardedState

if TYPE_CHECKING:
    from dtrain.trainer import Trainer


def _load_sharded(strategy: ShardedState, optimizer: torch.optim.Optimizer, path: Path) -> None:
    if not (path / ckread.SHARDED_DIR).is_dir():
        raise CheckpointError(
            f"{path} holds a full-state checkpoint (model.pt); this sharded strategy loads "
            "sharded ones: resume it with the strategy that saved it"
        )
    template = strategy.sharded_state_dict(optimizer)
    saved = {
        key[len("model.") :]: shape
        for key, shape in ckread.sharded_metadata(path).items()
        if key.startswith("model.")
    }
    wanted = {key: tuple(value.shape) for key, value in template["model"].items()}
    if dist.is_initialized():
        # A rank may hold only part of the model (a pipeline stage): compare the checkpoint
        # with what all ranks together hold.
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, wanted)
        wanted = {key: shape for part in every for key, shape in part.items()}
    check_model_fits(wanted, saved, path)
    ckread.load_sharded(path, template)
    strategy.load_sharded_state_dict(optimizer, template)


def checkpoint_files(trainer: Trainer) -> dict[str, Any]:
    """This rank's part of the training state, one file per component."""
    files: dict[str, Any] = {ckread.rng_file(trainer.runtime.rank): rng_state()}
    if trainer.runtime.is_main:
        files["train_state.pt"] = {
            "scheduler": trainer.scheduler.state_dict(),
            "data": trainer.loader.state_dict(),
            "trainer": trainer.state_dict(),
        }
        if trainer.strategy.replicated_state:
            files["model.pt"] = trainer.strategy.model_state_dict()
            files["optimizer.pt"] = trainer.strategy.optimizer_state_dict(trainer.optimizer)
    return files


def checkpoint_meta(trainer: Trainer) -> dict[str, Any]:
    return {
        "step": trainer.step,
        "world_size": trainer.runtime.world_size,
        "data_parallel_size": trainer.strategy.data_parallel_size,
        "strategy": trainer.cfg.strategy.name,
        "config": trainer.cfg.to_toml(),
        "dtrain_version": __version__,
        "torch_version": torch.__version__,
        "data": trainer.loader.state_dict(),
    }


def save(trainer: Trainer, *, blocking: bool) -> None:
    meta = checkpoint_meta(trainer) if trainer.runtime.is_main else None
    strategy = trainer.strategy
    sharded = (
        strategy.sharded_state_dict(trainer.optimizer)
        if isinstance(strategy, ShardedState)
        else None
    )
    trainer.checkpointer.save(
        trainer.step, checkpoint_files(trainer), meta, blocking=blocking, sharded=sharded
    )


def load(trainer: Trainer, point: ResumePoint, *, restore_data: bool = True) -> None:
    """Load every component from ``point``. With ``restore_data=False`` the loader keeps its
    position (a NaN rollback goes back in the model, not in the data stream)."""
    strategy = trainer.strategy
    path = point.path
    if isinstance(strategy, ShardedState):
        _load_sharded(strategy, trainer.optimizer, path)
    else:
        if not (path / "model.pt").exists():
            raise CheckpointError(
                f"{path} holds a sharded checkpoint (made by a sharded strategy such as fsdp); "
                f"strategy {trainer.cfg.strategy.name!r} loads full-state checkpoints: resume "
                "it with the strategy that saved it"
            )
        model_state = ckread.load_file(path, "model.pt")
        check_model_fits(strategy.model_state_dict(), model_state, path)
        strategy.load_model_state_dict(model_state)
        strategy.load_optimizer_state_dict(
            trainer.optimizer, ckread.load_file(path, "optimizer.pt")
        )
    train_state = ckread.load_file(path, "train_state.pt")
    trainer.scheduler.load_state_dict(train_state["scheduler"])
    if restore_data:
        trainer.loader.load_state_dict(train_state["data"])
    trainer.load_state_dict(train_state["trainer"])
    rng_path = path / ckread.rng_file(trainer.runtime.rank)
    if point.world_size == trainer.runtime.world_size and rng_path.exists():
        set_rng_state(ckread.load_file(path, rng_path.name))
        point.rng_restored = True
