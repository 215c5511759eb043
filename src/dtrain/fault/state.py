"""The training state: one dict of state_dicts, one key per component.

=================  ========================================  =========================
key                what                                      file (written by)
=================  ========================================  =========================
``model``          parameters and buffers                    model.pt (rank 0)
``optimizer``      optimizer state                           optimizer.pt (rank 0)
``scheduler``      LR schedule position                      train_state.pt (rank 0)
``data``           stream position, seed, dataset identity   train_state.pt (rank 0)
``trainer``        step, items seen, skipped steps, ...      train_state.pt (rank 0)
``rng``            Python, NumPy, torch (and CUDA) RNG       rng-rankNNNNN.pt (each rank)
meta               step, world size, config, versions        meta.json (rank 0)
=================  ========================================  =========================

Everything is tensors and plain data, loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dtrain import __version__
from dtrain.fault import checkpoint as ckpt
from dtrain.fault.resume import ResumePoint, check_model_fits
from dtrain.fault.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from dtrain.trainer import Trainer


def checkpoint_files(trainer: Trainer) -> dict[str, Any]:
    """This rank's part of the training state, one file per component."""
    files: dict[str, Any] = {ckpt.rng_file(trainer.runtime.rank): rng_state()}
    if trainer.strategy.replicated_state and trainer.runtime.is_main:
        files["model.pt"] = trainer.strategy.model_state_dict()
        files["optimizer.pt"] = trainer.strategy.optimizer_state_dict(trainer.optimizer)
        files["train_state.pt"] = {
            "scheduler": trainer.scheduler.state_dict(),
            "data": trainer.loader.state_dict(),
            "trainer": trainer.state_dict(),
        }
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
    trainer.checkpointer.save(trainer.step, checkpoint_files(trainer), meta, blocking=blocking)


def load(trainer: Trainer, point: ResumePoint, *, restore_data: bool = True) -> None:
    """Load every component from ``point``. With ``restore_data=False`` the loader keeps its
    position (a NaN rollback goes back in the model, not in the data stream)."""
    strategy = trainer.strategy
    path = point.path
    model_state = ckpt.load_file(path, "model.pt")
    check_model_fits(strategy.model_state_dict(), model_state, path)
    strategy.load_model_state_dict(model_state)
    strategy.load_optimizer_state_dict(trainer.optimizer, ckpt.load_file(path, "optimizer.pt"))
    train_state = ckpt.load_file(path, "train_state.pt")
    trainer.scheduler.load_state_dict(train_state["scheduler"])
    if restore_data:
        trainer.loader.load_state_dict(train_state["data"])
    trainer.load_state_dict(train_state["trainer"])
    rng_path = path / ckpt.rng_file(trainer.runtime.rank)
    if point.world_size == trainer.runtime.world_size and rng_path.exists():
        set_rng_state(ckpt.load_file(path, rng_path.name))
        point.rng_restored = True
