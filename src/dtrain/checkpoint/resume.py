"""Choosing the checkpoint to resume from (or, for the NaN guard, to roll back to), verified by
all the ranks together (how the work is shared and why no collective waits on it:
docs/fault-tolerance.md, "Resume").

A candidate any rank found damaged is skipped on every rank, with a warning naming the file; so
all ranks load the same step. Each component then checks that what it gets fits (the model
lists mismatched keys and shapes, the loader names a different seed or dataset) and says so in
one line.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from dtrain.checkpoint import copies
from dtrain.checkpoint import read as ckread
from dtrain.checkpoint.hold import job_id
from dtrain.checkpoint.layout import job_of, list_step_dirs
from dtrain.checkpoint.verify import assign, verify_pieces
from dtrain.checkpoint.write import Checkpointer
from dtrain.comm.plain import broadcast_json
from dtrain.config import Config
from dtrain.dist.runtime import Runtime
from dtrain.errors import CheckpointError, UserError
from dtrain.fault.peer_words import PeerWords
from dtrain.fault.watchdog import Watchdog
from dtrain.fsutil import local_run_dir
from dtrain.storage.objects import Location, location


@dataclass
class ResumePoint:
    path: Location
    step: int
    world_size: int
    strategy: str | None = None  # the strategy that saved it (None: not recorded)
    # Its data position (meta.json's copy of the loader's state): the loader reads ahead of it
    # while the rest loads (dtrain.data.loader.RankLoader.warm).
    data: dict[str, Any] | None = None
    # A store's checkpoint: what this rank verified of it, kept locally for the load, which
    # closes it (dtrain.checkpoint.state.load).
    kept: copies.Scope | None = field(default=None, repr=False, compare=False)

    def loaded(self) -> None:
        """The checkpoint is loaded (or failed to be): its local copies go."""
        if self.kept is not None:
            self.kept.close()


def candidates(
    cfg: Config, root: Location, log: Callable[[str], None], max_step: int | None = None
) -> list[Location]:
    """Rank 0's list, newest first, of the checkpoints to try: every one (``auto``), none
    (``never``), or the one ``run.resume`` names -- after this job's own, when it has saved
    any since (a restart goes on from where the job got, not back to where it started); for
    a rollback, every one up to ``max_step``. Removes leftovers of interrupted saves first."""
    for leftover in ckread.remove_leftovers(root):
        log(f"removed the leftover of an interrupted save: {leftover.name}")
    found = list_step_dirs(root)
    if max_step is not None:
        return [path for step, path in found if step <= max_step]
    if cfg.run.resume == "never":
        return []
    if cfg.run.resume == "auto":
        return [path for _, path in found]
    named = location(cfg.run.resume)
    job = job_id()
    ours = [path for _, path in found if job and job_of(path) == job]
    return [path for path in ours if path.resolve() != named.resolve()] + [named]


def starts_afresh(cfg: Config, root: Location) -> bool:
    """Whether this rank's run certainly starts at the beginning of the data, known before
    the model is set up: ``run.resume = "never"``, or ``auto`` with no checkpoint folder
    (committed or not) in ``root``, one listing. False when unsure (a checkpoint to choose,
    in-place recovery, where a replacement takes its peers' position): the choice
    (:func:`resolve_resume`) then tells."""
    if cfg.fault.recovery == "inplace" or cfg.run.resume not in ("auto", "never"):
        return False
    try:
        return cfg.run.resume == "never" or not list_step_dirs(root)
    except (OSError, UserError):  # said by the resume itself, where it matters
        return False


class TrainingDiverged(UserError):
    """The loss stayed non-finite and there was nothing to roll back to."""


def resolve_resume(
    cfg: Config,
    checkpointer: Checkpointer,
    runtime: Runtime,
    log: Callable[[str], None],
    max_step: int | None = None,
    *,
    watchdog: Watchdog,
) -> ResumePoint | None:
    """Collective: the newest candidate (:func:`candidates`) that every rank's share of
    verifies, on every rank; None when there is none. A ``run.resume`` folder that does not
    verify is an error. ``watchdog``: this rank's, through which the ranks wait for each
    other's verification (:class:`PeerWords`)."""
    decision: list[Any] = [[], None, ""]
    if runtime.is_main:
        try:
            found = candidates(cfg, checkpointer.root, log, max_step)
            decision = [[str(path) for path in found], None, uuid.uuid4().hex]
        except UserError as exc:
            decision = [[], str(exc), ""]
    if dist.is_initialized():
        decision = broadcast_json(decision, src=0)
    paths, error, nonce = decision
    if error:
        raise CheckpointError(error)
    named = max_step is None and cfg.run.resume not in ("auto", "never")
    words = PeerWords(watchdog)
    # One read of each byte from a store: what a rank verifies is what it loads.
    scope = copies.start(local_run_dir(cfg.run.dir, cfg.run.local_dir), checkpointer.root)
    point = None
    try:
        point = _first_verified(paths, named, runtime, words, nonce, log)
    finally:
        if scope is not None and point is None:
            scope.close()
    if point is not None:
        point.kept = scope
        checkpointer.note_verified(point.step)
    return point


def _first_verified(
    paths: list[str],
    named: bool,
    runtime: Runtime,
    words: PeerWords,
    nonce: str,
    log: Callable[[str], None],
) -> ResumePoint | None:
    """The first of ``paths`` that every rank's share of verifies (a ``named`` one that does
    not: an error); None when there is none."""
    for index, text in enumerate(paths):
        path = location(text)
        problem = verify_together(path, runtime, words, f"{nonce}/{index}")
        if problem is None:
            meta = ckread.load_meta(path)
            return ResumePoint(
                path,
                int(meta["step"]),
                int(meta["world_size"]),
                meta.get("strategy"),
                meta.get("data") if isinstance(meta.get("data"), dict) else None,
            )
        kept = copies.active()
        if kept is not None:
            kept.forget(path)  # what this rank kept of it is not loaded
        if named and index == len(paths) - 1:
            raise CheckpointError(problem)
        log(f"warning: skipping checkpoint {path.name}: {problem}")
    return None


def verify_together(path: Location, runtime: Runtime, words: PeerWords, key: str) -> str | None:
    """Collective: None when every rank's share of checkpoint ``path`` verifies, else what is
    wrong with it (every problem the ranks found, each naming its file)."""
    try:
        marker = ckread.read_marker(path)
        share = assign(marker, runtime.world_size)[runtime.rank]
        word = verify_pieces(path, share, words.tick) or ""
    except CheckpointError as exc:
        word = str(exc)
    except OSError as exc:
        word = f"{path}: cannot be read: {exc}"
    everyone = words.gather(key, word, f"check of checkpoint {path.name}")
    problems = list(dict.fromkeys(w for w in everyone if w))
    return "; ".join(problems) or None


def rollback_point(
    cfg: Config,
    checkpointer: Checkpointer,
    runtime: Runtime,
    log: Callable[[str], None],
    first_bad_step: int,
    last_bad_step: int,
    watchdog: Watchdog,
) -> ResumePoint:
    """Collective: where the NaN guard rolls back to after non-finite steps ``first_bad_step``
    to ``last_bad_step``. A checkpoint saved during the streak holds the same weights as the one
    before it (skipped steps change nothing), so: the newest one before the first bad step."""
    point = resolve_resume(cfg, checkpointer, runtime, log, first_bad_step - 1, watchdog=watchdog)
    if point is None:
        raise TrainingDiverged(
            f"the loss was non-finite for {last_bad_step - first_bad_step + 1} steps in a row "
            f"(steps {first_bad_step}-{last_bad_step}) and there is no checkpoint to roll back "
            "to; lower optim.lr, clip gradients (train.grad_clip) or check the data"
        )
    return point
