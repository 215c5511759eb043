"""Choosing the checkpoint to resume from (or, for the NaN guard, to roll back to).

Rank 0 decides (after removing the leftovers of interrupted saves) and tells the others, so all
ranks load the same step even if a save were to land meanwhile. The state is a dict of
state_dicts; each component checks that what it gets fits (the model lists mismatched keys and
shapes, the loader names a different seed or dataset) and says so in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dtrain.checkpoint import read as ckread
from dtrain.config import Config
from dtrain.errors import CheckpointError, UserError
from dtrain.runtime import Runtime


@dataclass
class ResumePoint:
    path: Path
    step: int
    world_size: int


def choose_checkpoint(
    cfg: Config,
    root: Path,
    log: Callable[[str], None],
    max_step: int | None = None,
    on_progress: Callable[[], None] | None = None,
) -> Path | None:
    """Rank 0's choice: the newest valid checkpoint (``auto``), none (``never``), or the one
    named by ``run.resume``. Removes leftovers of interrupted saves first. ``on_progress`` is
    called as the checkpoints' files are hashed."""
    for leftover in ckread.remove_leftovers(root):
        log(f"removed the leftover of an interrupted save: {leftover.name}")
    if max_step is not None:  # a rollback: the newest checkpoint from before a given step
        return ckread.find_latest_valid(root, max_step, on_progress)[0]
    if cfg.run.resume == "never":
        return None
    if cfg.run.resume == "auto":
        path, skipped = ckread.find_latest_valid(root, on_progress=on_progress)
        ckread.warn_skipped(skipped, log)
        return path
    path = Path(cfg.run.resume)
    ckread.verify_checkpoint(path, on_progress)
    return path


class TrainingDiverged(UserError):
    """The loss stayed non-finite and there was nothing to roll back to."""


def resolve_resume(
    cfg: Config,
    root: Path,
    runtime: Runtime,
    log: Callable[[str], None],
    max_step: int | None = None,
    on_progress: Callable[[], None] | None = None,
) -> ResumePoint | None:
    """Collective: the checkpoint rank 0 chose, on every rank (``on_progress``: called on
    rank 0 as it hashes the files)."""
    decision: list[Any] = [None, None]
    if runtime.is_main:
        try:
            path = choose_checkpoint(cfg, root, log, max_step, on_progress)
            decision = [str(path) if path else None, None]
        except UserError as exc:
            decision = [None, str(exc)]
    if dist.is_initialized():
        dist.broadcast_object_list(decision, src=0)
    chosen, error = decision
    if error:
        raise CheckpointError(error)
    if chosen is None:
        return None
    path = Path(chosen)
    meta = ckread.load_meta(path)
    return ResumePoint(path=path, step=int(meta["step"]), world_size=int(meta["world_size"]))


def rollback_point(
    cfg: Config,
    root: Path,
    runtime: Runtime,
    log: Callable[[str], None],
    first_bad_step: int,
    last_bad_step: int,
    on_progress: Callable[[], None] | None = None,
) -> ResumePoint:
    """Collective: where the NaN guard rolls back to after non-finite steps ``first_bad_step``
    to ``last_bad_step``. A checkpoint saved during the streak holds the same weights as the one
    before it (skipped steps change nothing), so: the newest one before the first bad step."""
    point = resolve_resume(cfg, root, runtime, log, first_bad_step - 1, on_progress)
    if point is None:
        raise TrainingDiverged(
            f"the loss was non-finite for {last_bad_step - first_bad_step + 1} steps in a row "
            f"(steps {first_bad_step}-{last_bad_step}) and there is no checkpoint to roll back "
            "to; lower optim.lr, clip gradients (train.grad_clip) or check the data"
        )
    return point
