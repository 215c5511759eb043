"""One whole model state dict from any strategy's checkpoint, in one process, at any world
size the checkpoint was saved at -- names as the user's model has them (which model each
form gives, localsgd's and diloco's replicas between syncs included: docs/models.md,
``dtrain export``).

Only reads, and only the files the completion marker lists, as tensors and plain data: nothing
in the run folder is written, moved or removed (an uncommitted or damaged checkpoint is skipped,
not cleaned up -- that is the training run's job).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from dtrain.errors import CheckpointError
from dtrain.storage.objects import Location

_REPLICA = re.compile(r"model-rank\d+\.pt")  # localsgd's, diloco's replicas of ranks > 0


@dataclass
class Consolidated:
    """A checkpoint's whole model: its state, the folder, and a note on how it was made
    (empty when the checkpoint held the model as it is)."""

    state: dict[str, torch.Tensor]
    step_dir: Location
    note: str = ""


def is_checkpoint_folder(path: Location) -> bool:
    """Whether ``path`` is one checkpoint's folder, committed or not: a ``step-N`` folder, one
    a save or a prune left (``.tmp-step-N``, ``.trash-step-N``), or any folder holding a
    marker, ``meta.json`` or ``dcp/`` (a renamed copy)."""
    name = path.name
    return (
        layout.step_of(name) is not None
        or layout.is_unfinished_step_dir_name(name)
        or any((path / part).exists() for part in (layout.MARKER, layout.META, layout.SHARDED_DIR))
    )


def find_checkpoint(path: Location) -> Location:
    """The committed checkpoint ``path`` names: a checkpoint's folder itself (verified against
    its marker), or in a run folder (or its ``checkpoints/``) the newest one that verifies."""
    return locate_checkpoint(path)[0]


def skipped_words(found: Location, skipped: list[tuple[Location, str]]) -> str:
    """The newer checkpoints :func:`locate_checkpoint` passed over, in one line: each one's
    folder and what was wrong with it, then the one taken instead (empty when none was)."""
    if not skipped:
        return ""
    passed = "; ".join(f"{where.name} ({why})" for where, why in skipped)
    return f"skipped {passed}: took {found.name}, the newest checkpoint that verifies"


def locate_checkpoint(
    path: Location, step: int | None = None
) -> tuple[Location, list[tuple[Location, str]]]:
    """:func:`find_checkpoint`, and the newer committed-looking checkpoints of a run folder
    it skipped because they do not verify, with the reason (:func:`skipped_words` says them):
    a caller that falls back to an older checkpoint says which it passed over and why."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if layout.is_unfinished_step_dir_name(path.name):
        # A save writes into .tmp-step-N and commits it only once renamed step-N (a prune
        # renames it .trash-step-N first): such a folder never counts, marker or not.
        raise CheckpointError(
            f"{path} is a checkpoint whose save did not finish (or one being removed): give "
            "the run folder or a committed step-N folder"
        )
    if is_checkpoint_folder(path):
        if step is not None and layout.step_of(path.name) not in (None, step):
            raise CheckpointError(f"{path} is the checkpoint of another step than {step}")
        ckread.verify_checkpoint(path)
        return path, []
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if step is not None:
        step_dir = root / layout.step_dir_name(step)
        if not step_dir.is_dir():
            have = layout.committed_steps(root)
            raise CheckpointError(
                f"{path} has no checkpoint of step {step} (committed: "
                f"{', '.join(map(str, sorted(have))) or 'none'})"
            )
        ckread.verify_checkpoint(step_dir)
        return step_dir, []
    found, skipped = ckread.find_latest_valid(root)
    if found is None:
        why = f" ({skipped[0][0].name}: {skipped[0][1]})" if skipped else ""
        raise CheckpointError(
            f"{path} holds no committed checkpoint{why}: a run writes one every "
            "checkpoint.every steps and at its end"
        )
    return found, skipped


def consolidate(step_dir: Location) -> Consolidated:
    """The whole model of the checkpoint in ``step_dir`` (verified by the caller), from the
    files its marker lists."""
    listed = ckread.read_marker(step_dir)["files"]
    if (step_dir / layout.SHARDED_DIR).is_dir():
        return Consolidated(read_sharded_model(step_dir), step_dir)
    if layout.MODEL_FILE not in listed:
        raise CheckpointError(f"{step_dir} holds neither {layout.MODEL_FILE} nor a sharded state")
    first = ckread.load_file(step_dir, layout.MODEL_FILE)
    replicas = sorted(name for name in listed if _REPLICA.fullmatch(name))
    if not replicas:
        return Consolidated(first, step_dir)
    others = [ckread.load_file(step_dir, name) for name in replicas]
    if all(_equal(first, other) for other in others):
        return Consolidated(first, step_dir)
    strategy = str(ckread.load_meta(step_dir).get("strategy", ""))
    if strategy == "diloco" and layout.OUTER_FILE in listed:
        anchor = ckread.load_file(step_dir, layout.OUTER_FILE)["anchor"]
        state = {**first, **{name: tensor for name, tensor in anchor.items() if name in first}}
        note = (
            f"{step_dir.name} was saved between outer steps: exported the anchor (the "
            "global model of the last outer step), with rank 0's buffers"
        )
        return Consolidated(state, step_dir, note)
    note = (
        f"{step_dir.name} was saved between syncs: exported the mean of its "
        f"{len(others) + 1} replicas (what the next sync makes of them)"
    )
    return Consolidated(_mean([first, *others]), step_dir, note)


def read_sharded_model(step_dir: Location) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint, whole, on CPU (no process group needed), read
    as data only (:mod:`dtrain.checkpoint.safe_dcp`)."""
    from dtrain.checkpoint.safe_dcp import load_sharded

    reader = ckread.sharded_reader(step_dir)
    saved = ckread.sharded_index(step_dir, reader).model
    template = {
        "model": {name: torch.empty_like(like, device="cpu") for name, like in saved.items()}
    }
    if not saved:
        raise CheckpointError(f"{step_dir / layout.SHARDED_DIR} holds no model tensors")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        load_sharded(template, reader, no_dist=True)
    return dict(template["model"])


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _mean(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Floating-point tensors averaged over the replicas; anything else rank 0's."""
    out = dict(states[0])
    for key, value in states[0].items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            total = torch.stack([s[key].double() for s in states]).mean(0)
            out[key] = total.to(value.dtype)
    return out
